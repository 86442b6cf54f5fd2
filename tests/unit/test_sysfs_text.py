"""hardware/sysfs.SysRoot.read_text on whatever bytes a node holds: control characters (but
newline and tab) and undecodable bytes are removed and counted as a problem, text is kept."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from edge_agent.hardware.sysfs import Problems, SysRoot


def _clean(data: bytes) -> str:
    text = data.replace(b"\x00", b" ").decode("utf-8", errors="replace")
    return "".join(c for c in text if c != "\ufffd" and (ord(c) >= 32 or c in "\n\t")).strip()


@given(st.binary(max_size=300) | st.text(max_size=300).map(str.encode))
def test_a_node_s_text_is_its_printable_characters(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as root:
        (Path(root) / "node").write_bytes(data)
        problems = Problems()
        got = SysRoot(root, problems=problems).read_text("node")
    assert got == _clean(data)
    decoded = data.replace(b"\x00", b" ").decode("utf-8", errors="replace")
    junk = any(c == "\ufffd" or (ord(c) < 32 and c not in "\n\t") for c in decoded)
    assert bool(problems.items) == junk


def test_proc_stat_keeps_its_lines() -> None:
    with tempfile.TemporaryDirectory() as root:
        text = "cpu  10 0 5 100 0 0 0 0 0 0\ncpu0 5 0 2 50 0 0 0 0 0 0\nintr 1\x01 2\n"
        (Path(root) / "stat").write_text(text)
        problems = Problems()
        got = SysRoot(root, problems=problems).read_text("stat")
    assert got.splitlines()[0] == "cpu  10 0 5 100 0 0 0 0 0 0" and got.splitlines()[2] == "intr 1 2"
    assert problems.items
