"""Build hook for the native int8 kernels; all metadata lives in pyproject.toml.

kernels/*.c are compiled into one plain shared library, edge_agent/_kernels*.so, loaded with
ctypes (it is not a CPython extension module). Each CPU variant (AVX2, AVX-VNNI,
AVX512-VNNI, NEON, NEON+SDOT) is compiled with its own flags; a variant the compiler refuses
(other architecture, too old a compiler) is left out, and any other failure -- no compiler
at all included -- only prints a warning: the package installs without the library and
the `native` engine reports itself unavailable with the reason.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
KERNELS = ROOT / "kernels"


def _warn(message: str) -> None:
    print(f"edge-agent kernels: {message}", file=sys.stderr, flush=True)


class BuildKernels(build_ext):
    """Compiles edge_agent._kernels variant by variant; never fails the install."""

    def build_extension(self, ext: Extension) -> None:
        if ext.name != "edge_agent._kernels":
            super().build_extension(ext)
            return
        target = Path(self.get_ext_fullpath(ext.name))
        target.unlink(missing_ok=True)  # never ship a stale library from an earlier build
        try:
            self._build_kernels(target)
        except Exception as exc:  # noqa: BLE001 - the library is optional by design
            _warn(f"not built ({type(exc).__name__}: {exc}); the 'native' int8 engine will be unavailable")

    def _compiler_command(self) -> list[str]:
        # The C compiler Python was built with (honours CC / CFLAGS like distutils does).
        compiler = getattr(self.compiler, "compiler_so", None)
        if compiler:
            return list(compiler)
        cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
        return shlex.split(cc) + ["-fPIC"]

    @staticmethod
    def _compiler_version(base: list[str]) -> str:
        try:
            out = subprocess.run([base[0], "--version"], capture_output=True, text=True, check=False, timeout=30)
            return (out.stdout.splitlines() or ["unknown compiler"])[0].strip()
        except (OSError, subprocess.SubprocessError):
            return "unknown compiler"

    def _compile(self, base: list[str], src: Path, obj: Path, flags: list[str]) -> tuple[bool, str]:
        cmd = [*base, *flags, f"-I{KERNELS}", "-c", str(src), "-o", str(obj)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in (proc.stderr or "").splitlines() if "error" in ln.lower()]
        reason = lines[0] if lines else (proc.stderr.strip()[:200] or f"{cmd[0]} exited with status {proc.returncode}")
        return proc.returncode == 0, reason

    def _build_kernels(self, target: Path) -> None:
        spec = json.loads((KERNELS / "variants.json").read_text())
        base = [*self._compiler_command(), *spec["cflags"], "-g0"]
        tmp = Path(self.build_temp) / "kernels"
        tmp.mkdir(parents=True, exist_ok=True)
        objects: list[str] = []
        defines: list[str] = []
        built: list[str] = []
        skipped: list[str] = []
        for variant in spec["variants"]:
            src = KERNELS / variant["source"]
            obj = tmp / (src.stem + ".o")
            reasons = []
            for flags in variant["flag_sets"]:
                ok, reason = self._compile(base, src, obj, flags)
                reasons.append(reason)
                if ok:
                    objects.append(str(obj))
                    defines.append(f"-D{variant['define']}")
                    built.append(f"{variant['name']}({' '.join(flags) or 'default flags'})")
                    break
            else:
                skipped.append(f"{variant['name']}: {reasons[0]}")
        if skipped:
            _warn("variants left out (the compiler refused them): " + "; ".join(skipped))
        info = f"{self._compiler_version(base)}; left out: {'; '.join(skipped) or 'none'}"
        info = "".join(ch if ch.isprintable() and ch not in '"\\' else " " for ch in info)[:400]
        for name in spec["common"]:
            src = KERNELS / name
            obj = tmp / (src.stem + ".o")
            extra = [*defines, f'-DEA_BUILD_INFO="{info}"'] if name == "dispatch.c" else []
            ok, reason = self._compile(base, src, obj, extra)
            if not ok:
                raise RuntimeError(f"{name} does not compile: {reason}")
            objects.append(str(obj))
        target.parent.mkdir(parents=True, exist_ok=True)
        link = getattr(self.compiler, "linker_so", None) or [base[0], "-shared"]
        cmd = [*link, *objects, "-pthread", "-o", str(target)]  # graph.c's thread pool
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"link failed: {proc.stderr.strip()[:300]}")
        _warn(f"built {target.name} with variants: portable, {', '.join(built) or 'none'}")


setup(
    # optional=True: setuptools then tolerates a missing library when copying in place.
    ext_modules=[Extension("edge_agent._kernels", sources=[], optional=True)],
    cmdclass={"build_ext": BuildKernels},
)
