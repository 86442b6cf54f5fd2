"""The Debian package, built by packaging/build-deb in its CI mode (`--mode thin`: only the
project's wheel, no registry), checked with the real tools: dpkg-deb --info/--contents,
lintian, and the maintainer scripts run by a real `dpkg --root` into a tree under tmp_path
(chrootless, so useradd/groupadd/deb-systemd-helper act on that tree through DPKG_ROOT).
The virtualenv helper is run for real with the Debian Python 3.11 into tmp_path.
"""

from __future__ import annotations

import hashlib
import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
ARCH = subprocess.run(["dpkg", "--print-architecture"], capture_output=True, text=True, check=True).stdout.strip()
MACHINE = {"amd64": ("x86_64", 62), "arm64": ("aarch64", 183)}[ARCH]


def sh(*cmd: str | Path, ok: bool = True, **kw: object) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)  # type: ignore[call-overload]
    if ok:
        assert proc.returncode == 0, f"{cmd}: {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deb")
    proc = sh(sys.executable, REPO / "packaging/build-deb", "--mode", "thin", "--out", out, "--workdir", out / "work")
    built = Path(proc.stdout.strip().splitlines()[-1])
    assert built == out / f"edge-agent_{VERSION}_{ARCH}.deb" and built.is_file()
    return built


@pytest.fixture(scope="module")
def tree(deb: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    extracted = tmp_path_factory.mktemp("extracted")
    sh("dpkg-deb", "-R", deb, extracted)
    return extracted


def test_control_fields(deb: Path) -> None:
    fields = dict(re.findall(r"^ ?([A-Za-z-]+): (.*)$", sh("dpkg-deb", "--info", deb).stdout, re.M))
    assert fields["Package"] == "edge-agent" and fields["Version"] == VERSION and fields["Architecture"] == ARCH
    # The device's own Python 3.11 builds the venv; useradd/groupadd come from passwd.
    assert {d.strip() for d in fields["Depends"].split(",")} == {
        "python3.11", "python3.11-venv", "passwd", "init-system-helpers (>= 1.54~)"}
    assert int(fields["Installed-Size"]) > 300  # KiB: the wheel alone is ~300
    assert "@" not in fields["Maintainer"].split("<")[0] and fields["Maintainer"].endswith(">")


def test_contents_owners_modes_and_payload(deb: Path, tree: Path) -> None:
    listing = {}
    for line in sh("dpkg-deb", "--contents", deb).stdout.splitlines():
        mode, owner, _size, _day, _time, path = line.split(maxsplit=5)
        listing[path.removeprefix("./")] = (mode, owner)
    assert {owner for _, owner in listing.values()} == {"root/root"}
    expected = {
        "lib/systemd/system/edge-agent.service": "-rw-r--r--",
        "usr/bin/edge-agent": "-rwxr-xr-x",
        "usr/libexec/edge-agent/build-venv": "-rwxr-xr-x",
        "usr/lib/edge-agent/wheels/requirements.txt": "-rw-r--r--",
        "usr/lib/edge-agent/wheels/SHA256SUMS": "-rw-r--r--",
        "usr/share/doc/edge-agent/copyright": "-rw-r--r--",
        "usr/share/doc/edge-agent/changelog.gz": "-rw-r--r--",
        "usr/share/doc/edge-agent/README.md": "-rw-r--r--",  # the unit's Documentation=
        "usr/share/doc/edge-agent/examples/mosquitto/acl": "-rw-r--r--",
        "usr/share/man/man1/edge-agent.1.gz": "-rw-r--r--",
        "usr/share/lintian/overrides/edge-agent": "-rw-r--r--",
    }
    for path, mode in expected.items():
        assert listing.get(path, (None,))[0] == mode, path
    # Nothing in /etc or /opt: the config comes from `edge-agent init`, the venv from the postinst.
    assert not [p for p in listing if p.startswith(("etc/", "opt/"))]
    assert not (tree / "DEBIAN/conffiles").exists()
    assert sorted(p.name for p in (tree / "DEBIAN").iterdir()) == ["control", "md5sums", "postinst", "postrm", "prerm"]

    # The unit is the packaging/ file itself, byte for byte (one source of truth).
    assert (tree / "lib/systemd/system/edge-agent.service").read_bytes() == \
        (REPO / "packaging/systemd/edge-agent.service").read_bytes()
    wheels = tree / "usr/lib/edge-agent/wheels"
    (wheel,) = wheels.glob("*.whl")
    assert wheel.name == f"mxedge_agent-{VERSION}-cp311-cp311-linux_{MACHINE[0]}.whl"
    assert (wheels / "SHA256SUMS").read_text() == f"{hashlib.sha256(wheel.read_bytes()).hexdigest()}  {wheel.name}\n"
    assert (wheels / "requirements.txt").read_text().splitlines()[1:] == [f"mxedge-agent=={VERSION}"]
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        (lib,) = [n for n in names if re.fullmatch(r"edge_agent/_kernels.*\.so", n)]
        assert int.from_bytes(zf.read(lib)[18:20], "little") == MACHINE[1]  # built for the target CPU
        assert any(n.endswith("data/share/edge-agent/firmware_configs/raspberry-pi-4.toml") for n in names)
    for script in ("postinst", "prerm", "postrm"):
        sh("sh", "-n", tree / "DEBIAN" / script)
    assert not re.search(r"@[A-Z_]+@", (tree / "usr/libexec/edge-agent/build-venv").read_text())


def test_lintian_has_no_errors_or_warnings_and_every_override_is_justified(deb: Path) -> None:
    proc = sh("lintian", "-EvIL", "+pedantic", "--show-overrides", "--tag-display-limit", "0", deb, ok=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    tags = [ln for ln in proc.stdout.splitlines() if re.match(r"^[EWIPXO]: ", ln)]
    assert not [t for t in tags if t[0] in "EW"], tags
    assert [t for t in tags if not t.startswith("O: ")] == []  # info and pedantic ones too
    overrides = (REPO / "packaging/debian/lintian-overrides").read_text().split("\n\n")
    stanzas = [s for s in overrides if "edge-agent: " in s]
    assert len(stanzas) == len([t for t in tags if t.startswith("O: ")]) >= 1
    for stanza in stanzas:
        assert stanza.lstrip().startswith("#"), f"override without a reason: {stanza}"


def _dpkg_root(tmp_path: Path) -> Path:
    root = tmp_path / "device"
    for d in ("var/lib/dpkg/info", "var/lib/dpkg/updates", "var/lib/dpkg/triggers", "etc"):
        (root / d).mkdir(parents=True)
    for f in ("var/lib/dpkg/status", "var/lib/dpkg/available"):
        (root / f).touch()
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    (root / "etc/group").write_text("root:x:0:\nvideo:x:44:\n")
    (root / "etc/shadow").write_text("root:*:19000:0:99999:7:::\n")
    (root / "etc/gshadow").write_text("root:*::\n")
    return root


def _dpkg(root: Path, *args: str | Path) -> str:
    return sh("dpkg", f"--root={root}", "--force-script-chrootless", "--force-depends", *args).stderr


def _db(root: Path, name: str) -> dict[str, list[str]]:
    return {ln.split(":")[0]: ln.split(":") for ln in (root / "etc" / name).read_text().splitlines()}


def test_maintainer_scripts_keep_config_and_state_until_purge(deb: Path, tree: Path, tmp_path: Path) -> None:
    root = _dpkg_root(tmp_path)
    wants = root / "etc/systemd/system/multi-user.target.wants/edge-agent.service"

    _dpkg(root, "-i", deb)
    user = _db(root, "passwd")["edge-agent"]
    assert user[5:] == ["/var/lib/edge-agent", "/usr/sbin/nologin"] and int(user[2]) < 1000
    groups = _db(root, "group")
    assert {"i2c", "gpio", "video", "plugdev", "edge-agent"} <= set(groups)  # the unit's groups all exist
    assert groups["video"][2] == "44"  # an existing group is left alone
    gid = int(groups["edge-agent"][2])
    for path, uid in (("etc/edge-agent", 0), ("var/lib/edge-agent", int(user[2]))):
        st = (root / path).stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (uid, gid, 0o750), path
    assert wants.is_symlink() and os.readlink(wants) == "/lib/systemd/system/edge-agent.service"
    assert not (root / "opt").exists()  # no venv built from outside the device's root
    (root / "etc/edge-agent/agent.toml").write_text("[device]\nid = 'pi-1'\n")
    (root / "var/lib/edge-agent/device.key").write_text("key")

    # Upgrade to a newer version of the same payload: nothing of the device's is touched.
    newer = tmp_path / "newer"
    shutil.copytree(tree, newer, symlinks=True)
    control = newer / "DEBIAN/control"
    control.write_text(control.read_text().replace(f"Version: {VERSION}\n", f"Version: {VERSION}.1\n"))
    sh("dpkg-deb", "--root-owner-group", "--build", newer, tmp_path / "newer.deb")
    _dpkg(root, "-i", tmp_path / "newer.deb")
    assert re.search(rf"Package: edge-agent\nStatus: install ok installed\n(.+\n)*Version: {VERSION}\.1\n",
                     (root / "var/lib/dpkg/status").read_text())
    assert (root / "etc/edge-agent/agent.toml").read_text() == "[device]\nid = 'pi-1'\n"
    assert (root / "var/lib/edge-agent/device.key").read_text() == "key"
    assert wants.is_symlink() and list(_db(root, "passwd")).count("edge-agent") == 1

    _dpkg(root, "--remove", "edge-agent")
    assert not (root / "lib/systemd/system/edge-agent.service").exists()
    assert not (root / "usr/bin/edge-agent").exists()
    assert (root / "etc/edge-agent/agent.toml").exists() and (root / "var/lib/edge-agent/device.key").exists()
    assert os.readlink(root / "etc/systemd/system/edge-agent.service") == "/dev/null"  # masked until purge

    _dpkg(root, "--purge", "edge-agent")
    assert not (root / "etc/edge-agent").exists() and not (root / "var/lib/edge-agent").exists()
    assert not (root / "etc/systemd/system/edge-agent.service").is_symlink() and not wants.is_symlink()
    assert "edge-agent" in _db(root, "passwd")  # users are kept, as Debian does
    with pytest.raises(KeyError):
        pwd.getpwnam("edge-agent")  # and this machine never saw any of it


def test_build_venv_installs_the_wheel_with_the_system_python_and_prunes(tree: Path, tmp_path: Path) -> None:
    opt = tmp_path / "opt"
    env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "EDGE_AGENT_OPT": str(opt),
           "EDGE_AGENT_WHEELS": str(tree / "usr/lib/edge-agent/wheels"),
           # thin mode takes dependencies from the index; here there is none, and the
           # agent's --version needs none of them.
           "PIP_NO_INDEX": "1", "PIP_NO_DEPS": "1"}
    helper = tree / "usr/libexec/edge-agent/build-venv"
    (opt / "venv-0.0.9/bin").mkdir(parents=True)  # a previous version's venv
    out = sh(helper, env=env).stdout
    assert "building" in out
    venv = opt / f"venv-{VERSION}"
    assert os.readlink(opt / "venv") == f"venv-{VERSION}"
    # Built by the device's Python (Depends: python3.11), not by whatever built the package.
    assert "home = /usr/bin\n" in (venv / "pyvenv.cfg").read_text()
    assert sh(opt / "venv/bin/edge-agent", "--version").stdout.strip() == f"edge-agent {VERSION}"
    assert list((venv / "lib/python3.11/site-packages/edge_agent").glob("_kernels*.so"))

    python_inode = (venv / "bin/python").lstat().st_ino
    assert "up to date" in sh(helper, env=env).stdout
    assert (venv / "bin/python").lstat().st_ino == python_inode  # not rebuilt
    assert (opt / "venv-0.0.9").exists()  # kept until the service has restarted
    sh(helper, "--prune", env=env)
    assert sorted(p.name for p in opt.iterdir()) == ["venv", f"venv-{VERSION}"]


def test_wrapper_explains_a_missing_venv(tree: Path) -> None:
    if Path("/opt/edge-agent/venv/bin/edge-agent").exists():
        pytest.fail("this test assumes edge-agent is not installed from the .deb on this machine")
    proc = sh(tree / "usr/bin/edge-agent", "--version", ok=False)
    assert proc.returncode == 69 and "/usr/libexec/edge-agent/build-venv" in proc.stderr


def _build_deb_module():  # noqa: ANN202 - the script has no .py suffix
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.SourceFileLoader("build_deb", str(REPO / "packaging/build-deb"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("build_deb", loader))
    loader.exec_module(module)
    return module


def test_offline_requirements_pin_every_wheel_by_hash_for_pip(tree: Path, tmp_path: Path) -> None:
    """The release wheelhouse's requirements.txt, checked by pip itself (resolve only)."""
    wheels = tmp_path / "wheels"
    shutil.copytree(tree / "usr/lib/edge-agent/wheels", wheels)
    (wheels / "requirements.txt").unlink()
    _build_deb_module().write_wheel_index(wheels, "offline", VERSION)
    (wheel,) = wheels.glob("*.whl")
    assert (wheels / "requirements.txt").read_text().splitlines()[1:] == [
        f"mxedge-agent=={VERSION} --hash=sha256:{hashlib.sha256(wheel.read_bytes()).hexdigest()}"]
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--no-index", "--require-hashes",
           "--only-binary=:all:", "--find-links", str(wheels), "--target", str(tmp_path / "t"),
           "-r", str(wheels / "requirements.txt")]
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull}
    assert f"Would install mxedge-agent-{VERSION}" in sh(*cmd, env=env).stdout
    wheel.write_bytes(wheel.read_bytes() + b"tampered")
    proc = sh(*cmd, env=env, ok=False)
    assert proc.returncode != 0 and "THESE PACKAGES DO NOT MATCH THE HASHES" in proc.stderr


def test_build_deb_refuses_an_unknown_architecture() -> None:
    proc = sh(sys.executable, REPO / "packaging/build-deb", "--arch", "i386", ok=False)
    assert proc.returncode == 2 and "invalid choice: 'i386'" in proc.stderr


# ------------------------------------------------------------------ arm64 and armhf (issue 13)

def test_platform_tags_accept_bookworm_wheels() -> None:
    """tflite-runtime 2.14.0's aarch64 wheel is manylinux_2_34 and cryptography's armv7l one
    manylinux_2_31: Bookworm's glibc 2.36 runs both, so the download must accept them."""
    from packaging.tags import Tag
    from packaging.utils import parse_wheel_filename

    bd = _build_deb_module()
    for arch, wheel in (("arm64", "tflite_runtime-2.14.0-cp311-cp311-manylinux_2_34_aarch64.whl"),
                        ("armhf", "cryptography-50.0.2-cp311-abi3-manylinux_2_31_armv7l.whl")):
        accepted = {Tag(i, a, plat) for plat in bd.ARCHES[arch][3] for i in ("cp311", "py3") for a in ("cp311", "abi3")}
        assert parse_wheel_filename(wheel)[3] & accepted, (arch, wheel)
    assert "manylinux_2_37_aarch64" not in bd.ARCHES["arm64"][3]  # newer than Bookworm's glibc


def test_target_dependencies_are_judged_for_the_target_not_this_host() -> None:
    bd = _build_deb_module()
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {d.split("=")[0].split("<")[0].split(">")[0].split(";")[0].strip() for d in deps}
    arm64 = {r.split("=")[0].split("<")[0].split(">")[0] for r in bd.target_dependencies(deps, "arm64")}
    armhf = {r.split("=")[0].split("<")[0].split(">")[0] for r in bd.target_dependencies(deps, "armhf")}
    assert {"mxnet", "tflite-runtime", "numpy"} <= arm64 == names
    # 32-bit Pi OS: no MXNet/onnx/tflite-runtime wheels; numpy, cryptography and the local
    # inference service's starlette, uvicorn and Pillow are Debian's.
    assert armhf == names - {"mxnet", "onnx", "tflite-runtime", "numpy", "cryptography", "starlette", "uvicorn",
                             "Pillow"}
    assert all(";" not in r for r in bd.target_dependencies(deps, "armhf"))


@pytest.fixture(scope="module")
def armhf_deb(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("deb-armhf")
    proc = sh(sys.executable, REPO / "packaging/build-deb", "--arch", "armhf", "--mode", "thin", "--out", out,
              "--workdir", out / "work")
    return Path(proc.stdout.strip().splitlines()[-1])


def test_armhf_package_for_32_bit_pi_os(armhf_deb: Path, tmp_path: Path) -> None:
    fields = dict(re.findall(r"^ ?([A-Za-z-]+): (.*)$", sh("dpkg-deb", "--info", armhf_deb).stdout, re.M))
    assert fields["Architecture"] == "armhf"
    depends = {d.strip() for d in fields["Depends"].split(",")}
    assert {"python3-numpy", "python3-cryptography"} <= depends
    sh("dpkg-deb", "-R", armhf_deb, tmp_path)
    wheels = tmp_path / "usr/lib/edge-agent/wheels"
    (wheel,) = wheels.glob("*.whl")
    assert wheel.name.endswith("-linux_armv7l.whl")
    with zipfile.ZipFile(wheel) as zf:
        (lib,) = [n for n in zf.namelist() if re.fullmatch(r"edge_agent/_kernels.*\.so", n)]
        assert lib.endswith("arm-linux-gnueabihf.so") and int.from_bytes(zf.read(lib)[18:20], "little") == 40
    reqs = (wheels / "requirements.txt").read_text().splitlines()[1:]
    assert reqs[0] == f"mxedge-agent=={VERSION}" and not any(
        r.startswith(("mxnet", "onnx", "numpy", "tflite-runtime", "cryptography")) for r in reqs), reqs
    helper = (tmp_path / "usr/libexec/edge-agent/build-venv").read_text()
    assert 'SYSTEM_SITE="--system-site-packages"' in helper and 'NO_DEPS="--no-deps"' in helper
    assert 'DOCTOR="no"' in helper


def test_arm64_package_depends_on_what_the_repaired_mxnet_needs(tmp_path: Path) -> None:
    proc = sh(sys.executable, REPO / "packaging/build-deb", "--arch", "arm64", "--mode", "thin", "--out", tmp_path,
              "--workdir", tmp_path / "work")
    deb = Path(proc.stdout.strip().splitlines()[-1])
    fields = dict(re.findall(r"^ ?([A-Za-z-]+): (.*)$", sh("dpkg-deb", "--info", deb).stdout, re.M))
    depends = {d.strip() for d in fields["Depends"].split(",")}
    assert {"libopenblas0-pthread", "liblapacke", "libgomp1", "libgfortran5", "patchelf"} <= depends
    sh("dpkg-deb", "-R", deb, tmp_path / "x")
    helper = (tmp_path / "x/usr/libexec/edge-agent/build-venv").read_text()
    assert 'DOCTOR="yes"' in helper and 'SYSTEM_SITE=""' in helper


def test_mxnet_wheel_repair_keeps_the_wheel_valid(tmp_path: Path) -> None:
    """repair_mxnet_wheel on a wheel whose libmxnet.so NEEDs ArmPL: the repaired wheel's
    RECORD matches its files (pip checks it), the repair record is inside, and the result
    is cached by the original wheel's sha256."""
    from edge_agent import doctor
    from tests.unit.test_doctor import _armpl_linked_library

    lib = _armpl_linked_library(tmp_path)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    name = "mxnet-1.9.1-py3-none-manylinux2014_aarch64.whl"
    files = {"mxnet/__init__.py": b"", "mxnet/libmxnet.so": lib.read_bytes(),
             "mxnet-1.9.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: mxnet\nVersion: 1.9.1\n",
             "mxnet-1.9.1.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: py3-none-any\n"}
    bd = _build_deb_module()
    record = "".join(f"{n},{bd._record_hash(d)},{len(d)}\n" for n, d in files.items())
    record += "mxnet-1.9.1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(wheels / name, "w") as zf:
        for n, d in files.items():
            zf.writestr(n, d)
        zf.writestr("mxnet-1.9.1.dist-info/RECORD", record)
    original = hashlib.sha256((wheels / name).read_bytes()).hexdigest()
    info = bd.repair_mxnet_wheel(wheels, tmp_path / "cache")
    assert info["wheel_original_sha256"] == original != info["wheel_repaired_sha256"]
    sh(sys.executable, "-m", "wheel", "unpack", "--dest", tmp_path / "unpacked", wheels / name)  # checks RECORD
    unpacked = tmp_path / "unpacked/mxnet-1.9.1/mxnet"
    assert "libopenblas.so.0" in doctor.needed_libraries(unpacked / "libmxnet.so")
    inside = json.loads((unpacked / doctor.REPAIR_RECORD).read_text())
    assert inside["repaired_sha256"] == doctor.sha256_file(unpacked / "libmxnet.so")
    assert (tmp_path / "cache" / original / name).is_file()
