"""bench/run.py, which rewrites BENCHMARKS.md: a failed benchmark never replaces its figures,
and no section carries one machine's absolute paths (issue 35 items 17 and 19). The
benchmarks themselves are not run: `bench.run`'s module loader is handed stand-ins."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from bench import run as bench_run

EARLIER = """# Benchmarks

<!-- bench:bench_kernels -->
## Native int8 kernels

| target | measured |
|---|---:|
| int8 GEMM vs numpy | 1.62x |

_Produced by `python -m bench.run --only bench_kernels` on 2026-12-03 in 900 s._
<!-- /bench:bench_kernels -->

<!-- bench:bench_codec -->
## Codec

x100 smaller.
<!-- /bench:bench_codec -->
"""


def _run(monkeypatch: pytest.MonkeyPatch, output: Path, modules: dict[str, object], *only: str) -> int:
    monkeypatch.setattr(bench_run, "importlib", SimpleNamespace(import_module=lambda name: modules[name]))
    return bench_run.main(["--only", *only, "--output", str(output)])


def _failing(exc: Exception) -> SimpleNamespace:
    def run(quick: bool = False) -> str:
        raise exc

    return SimpleNamespace(run=run)


def test_a_failed_benchmark_keeps_its_earlier_figures_and_says_the_new_run_failed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "BENCHMARKS.md"
    output.write_text(EARLIER)
    timeout = TimeoutError("int8_ports ran past 120 s of wall time")
    assert _run(monkeypatch, output, {"bench.bench_kernels": _failing(timeout)}, "bench_kernels") == 1
    text = output.read_text()
    assert "| int8 GEMM vs numpy | 1.62x |" in text and "FAILED:" not in text  # the figures stay
    note = next(line for line in text.splitlines() if line.startswith("_Latest run FAILED"))
    assert "TimeoutError: int8_ports ran past 120 s of wall time" in note and "python -m bench.run" in note
    assert text.index(note) < text.index("<!-- /bench:bench_kernels -->")  # inside its own section
    assert "x100 smaller." in text  # the other sections are untouched
    assert "bench_kernels FAILED" in capsys.readouterr().err
    # a second failure does not stack notes; a good run replaces the section, note and all
    _run(monkeypatch, output, {"bench.bench_kernels": _failing(timeout)}, "bench_kernels")
    assert output.read_text().count("_Latest run FAILED") == 1
    good = SimpleNamespace(run=lambda quick=False: "## Native int8 kernels\n\n| int8 GEMM vs numpy | 1.70x |\n")
    assert _run(monkeypatch, output, {"bench.bench_kernels": good}, "bench_kernels") == 0
    text = output.read_text()
    assert "1.70x" in text and "1.62x" not in text and "_Latest run FAILED" not in text


def test_a_benchmark_without_earlier_figures_gets_a_failed_section(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    output = tmp_path / "BENCHMARKS.md"
    output.write_text(EARLIER)
    assert _run(monkeypatch, output, {"bench.bench_depth": _failing(RuntimeError("no MXNet"))}, "bench_depth") == 1
    text = output.read_text()
    assert "<!-- bench:bench_depth -->\n## bench_depth\n\nFAILED:" in text and "RuntimeError: no MXNet" in text


def test_sections_name_repository_paths_relative_to_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """bench_model_zoo printed '/work/main/tests/fixtures/models/...onnx' from an import error."""
    fixture = bench_run.ROOT / "tests" / "fixtures" / "models" / "shufflenet_v2_x0_5.legacy.onnx"
    body = (f"## Model zoo\n\nNot imported yet:\n- torch-shufflenet: BundleError: {fixture}: op 'Shape'\n"
            f"- cache in {Path.home() / '.cache' / 'zoo'}\n")
    output = tmp_path / "BENCHMARKS.md"
    assert _run(monkeypatch, output, {"bench.bench_model_zoo": SimpleNamespace(run=lambda quick=False: body)},
                "bench_model_zoo") == 0
    text = output.read_text()
    assert "BundleError: tests/fixtures/models/shufflenet_v2_x0_5.legacy.onnx: op 'Shape'" in text
    assert str(bench_run.ROOT) not in text and str(Path.home()) not in text and "~/.cache/zoo" in text
