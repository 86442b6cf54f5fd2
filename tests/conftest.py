"""Shared test fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"


def pytest_configure(config: pytest.Config) -> None:
    """Nothing a test runs may write the machine's own state directory (/var/lib/edge-agent
    as root, ~/.local/state otherwise): `kernels` and `finetune` without --cache-dir cache
    the engine choice there. One throw-away directory per test session instead."""
    import os
    import tempfile

    if "EDGE_AGENT_STATE_DIR" not in os.environ:
        config._edge_state_dir = tempfile.mkdtemp(prefix="edge-agent-test-state-")  # type: ignore[attr-defined]
        os.environ["EDGE_AGENT_STATE_DIR"] = config._edge_state_dir  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    made = getattr(config, "_edge_state_dir", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


def new_head_version(base_dir: Path, dest: Path, *, version: str, shift: float):
    """The bundle at `base_dir` with its head parameters moved by `shift`, written as
    version `version` at `dest`: what a federated round produces (backbone unchanged)."""
    import numpy as np

    from edge_agent.int8 import bundle as B
    from edge_agent.mxparams import dump_params, load_params

    base = B.load_bundle(base_dir)
    files = {f: base.read(f) for f in base.manifest.files}
    head = load_params(files[B.HEAD_PARAMS])
    files[B.HEAD_PARAMS] = dump_params({k: (v + np.float32(shift)).astype(v.dtype) for k, v in head.items()})
    manifest = base.manifest
    manifest.version, manifest.parent_version = version, base.manifest.version
    return B.write_bundle_dir(dest, files, manifest)
