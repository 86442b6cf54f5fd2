"""What the docs and --help texts tell users to run must be safe and must point at what exists.

- `pip install` never names a package that resolves to somebody else's project on the
  public index (`edge-agent` there is an unrelated "agent framework"): every requirement
  is a path, a wheel file, a requirements file, a declared dependency, or our own
  distribution with an explicit local source.
- Links and mentions of `*.md` files resolve to files in the repository.
- `make-certs --help` names the ACL file the broker config needs.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest

from edge_agent import cli as agent_cli
from edge_agent.coordinator import cli as coordinator_cli

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
DIST = PROJECT["name"]


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared_dependencies() -> set[str]:
    """Third-party names the project pins (their owners are who we mean)."""
    reqs = list(PROJECT["dependencies"])
    for extra in PROJECT.get("optional-dependencies", {}).values():
        reqs += extra
    return {_norm(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in reqs} - {_norm(DIST)}


DECLARED = _declared_dependencies()


def _load_script(path: Path):  # noqa: ANN202
    loader = importlib.machinery.SourceFileLoader(path.name.replace("-", "_"), str(path))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _all_help(parser: argparse.ArgumentParser) -> Iterator[str]:
    yield parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):  # aliases share a parser
                yield from _all_help(sub)


def doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            *sorted((REPO / "packaging").rglob("README.md"))]


def help_texts() -> dict[str, str]:
    texts = {f"edge-agent #{i}": t for i, t in enumerate(_all_help(agent_cli.build_parser()))}
    texts |= {f"edge-coordinator #{i}": t for i, t in enumerate(_all_help(coordinator_cli.build_parser()))}
    texts["packaging/debian/edge-agent.1"] = (REPO / "packaging/debian/edge-agent.1").read_text()
    for script in ("packaging/build-deb", "packaging/mosquitto/make-certs"):
        module = _load_script(REPO / script)
        texts[script] = (module.__doc__ or "") + getattr(module, "EPILOG", "")
    return texts


def command_text(text: str, markdown: bool) -> str:
    """The parts of a text that are commands: code blocks and spans in Markdown, indented
    example lines in a --help text (prose such as "a pip install of the wheel" is not)."""
    text = re.sub(r"\\\n", " ", text)  # shell line continuations
    if markdown:
        blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S)
        spans = re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.M | re.S))
        return "\n".join(blocks + spans)
    return "\n".join(line for line in text.splitlines() if line.startswith("  "))


def pip_install_requirements(text: str) -> Iterator[tuple[str, list[str]]]:
    """(the command, its requirement arguments) for every `pip install` in command text."""
    for line in text.splitlines():
        line = re.sub(r"(^|\s)#.*", "", line)  # a shell comment is not a command ("# after pip install on a Pi")
        for match in re.finditer(r"\bpip3?\s+install\b([^`;&|)]*)", line):
            try:
                words = shlex.split(match.group(1))
            except ValueError:
                words = match.group(1).split()
            reqs, skip = [], False
            for word in words:
                if skip:
                    skip = False
                elif word in ("-r", "--requirement", "-c", "--constraint", "--find-links", "-f", "--target",
                              "-t", "--index-url", "-i", "--platform", "--dest", "-d", "--prefix"):
                    skip = True  # its value is a file or an option, not a requirement
                elif not word.startswith("-"):
                    reqs.append(word)
            yield match.group(0), reqs


def unsafe_requirements(text: str, markdown: bool = True) -> list[str]:
    bad = []
    for command, reqs in pip_install_requirements(command_text(text, markdown)):
        local_source = re.search(r"--no-index\b", command) and re.search(r"--find-links|-f\s", command)
        for req in reqs:
            name = re.match(r"[A-Za-z0-9._-]*", req).group(0)
            is_path = req.startswith(("./", "../", "/", "~", "file:")) or ".whl" in req or "/" in req
            if is_path or _norm(name) in DECLARED or (_norm(name) == _norm(DIST) and local_source):
                continue
            if " @ " in command and req.startswith(("file:", "/")):
                continue
            bad.append(f"{command.strip()!r}: {req!r}")
    return bad


def test_the_scanner_catches_a_bare_name_and_allows_local_sources() -> None:
    assert unsafe_requirements("run `sudo venv/bin/pip install edge-agent` first") == [
        "'pip install edge-agent': 'edge-agent'"]
    assert unsafe_requirements("```sh\npython3.11 -m venv v && v/bin/pip install 'edge-agent[demo]'\n```\n")
    assert unsafe_requirements(f"`pip install {DIST}`")  # ours, but not on the index: squattable
    assert unsafe_requirements("```\npip install \\\n    --quiet -U edge-agent\n```\n")
    assert unsafe_requirements("examples:\n  sudo pip install edge-agent\n", markdown=False)
    assert unsafe_requirements(f"`pip install --no-index --find-links wheels/ {DIST}`") == []
    assert unsafe_requirements("`pip install ./mxedge_agent-0.1.0-*.whl '/path/to/checkout[demo]'`") == []
    assert unsafe_requirements("`pip install -r wheels/requirements.txt amqtt==0.12.1 Pillow`") == []
    assert unsafe_requirements("prose: a pip install of the wheel, then `edge-agent init`") == []
    assert unsafe_requirements("examples:\n  edge-agent doctor --fix   # after pip install on a Pi\n",
                               markdown=False) == []


def test_the_distribution_name_is_not_the_one_an_unrelated_project_holds() -> None:
    assert _norm(DIST) != "edge-agent"
    scripts = PROJECT["scripts"]
    assert scripts["edge-agent"] == "edge_agent.cli:main"  # the commands keep their names
    assert scripts["edge-coordinator"] == "edge_agent.coordinator.cli:main"
    test_extra = [_norm(r) for r in PROJECT["optional-dependencies"]["test"]]
    own = [r for r in test_extra if r.startswith(f"{_norm(DIST)}[")]  # the extra names the project itself
    assert own and "demo" in own[0].split("[", 1)[1].rstrip("]").split(","), test_extra
    assert not [r for r in test_extra if r.startswith("edge-agent")]


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_never_pip_install_a_name_that_resolves_elsewhere(doc: Path) -> None:
    assert unsafe_requirements(doc.read_text()) == []


def test_help_texts_never_pip_install_a_name_that_resolves_elsewhere() -> None:
    texts = help_texts()
    assert len(texts) > 20  # every subcommand of both CLIs was reached
    assert any("pip install" in t for t in texts.values())  # the scan sees the install examples
    bad = {name: found for name, t in texts.items() if (found := unsafe_requirements(t, markdown=False))}
    assert bad == {}


def _md_references(text: str) -> Iterator[str]:
    for target in re.findall(r"\]\(([^)#\s]+)", text):  # markdown links
        if not re.match(r"[a-z]+:", target):
            yield target
    yield from re.findall(r"(?<![\w/(.-])([\w./-]*\.md)\b", text)  # bare mentions: DESIGN.md


@pytest.mark.parametrize("doc", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_markdown_file_a_doc_links_or_names_exists(doc: Path) -> None:
    anywhere = {p.name for p in REPO.glob("*.md")} | {  # the project's own dirs, not build/ or .venv
        p.name for d in ("docs", "packaging", "edge_agent", "tests") for p in (REPO / d).rglob("*.md")}
    missing = [ref for ref in _md_references(doc.read_text())
               if not ((doc.parent / ref).exists() or (REPO / ref).exists() or ref in anywhere)]
    assert missing == []


def test_make_certs_help_names_the_acl_and_config_the_broker_needs() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "packaging/mosquitto/make-certs"), "--help"],
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    conf = (REPO / "packaging/mosquitto/edge-agent-fleet.conf").read_text()
    (acl_path,) = re.findall(r"^acl_file\s+(\S+)", conf, re.M)
    assert "packaging/mosquitto/acl" in text and (REPO / "packaging/mosquitto/acl").is_file()
    assert acl_path in text  # where the config looks for it
    assert "packaging/mosquitto/edge-agent-fleet.conf /etc/mosquitto/conf.d/" in text
    # every file the install lines copy from the repository exists
    for src in re.findall(r"(packaging/mosquitto/[\w.-]+)", text):
        assert (REPO / src).is_file(), src
