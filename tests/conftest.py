"""Shared test fixtures."""

from __future__ import annotations

import os
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

    config.addinivalue_line("markers", "sqlite_only(reason): the test reads the SQLite registry file itself")
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


def reference_head(reg, job_id: str, number: int, *, accepted_only: bool = True):
    """What the round's rule must publish, from its dense reference (strategies/) over the
    stored updates decoded, with the label counts and predictions each device reported (its claims,
    strategies/claims.py, read as aggregation.contribution reads them): base + reference
    aggregate. For checking an engine's streaming close end to end (no server set: the rules
    that need none; a job's first round: no earlier standing)."""
    import numpy as np

    from edge_agent.coordinator.aggregate import apply_delta
    from edge_agent.coordinator.aggregation import strategy_options
    from edge_agent.coordinator.rounds import RoundPolicy
    from edge_agent.coordinator.strategies import DenseUpdate, RoundEvidence, make_strategy
    from edge_agent.coordinator.strategies.claims import output_classes
    from edge_agent.coordinator.streaming import Layout
    from edge_agent.protocol.label_claims import decode_counts, decode_predicted

    job, rnd = reg.get_job(job_id), reg.get_round(job_id, number)
    base = reg.load_head(reg.get_model(job.model_name, rnd.base_version))
    layout = Layout(base)
    classes = output_classes(layout)
    ups = []
    for u in reg.list_updates(job_id, number):
        if accepted_only and u.status.value != "accepted":
            continue
        d = reg.load_delta(u)
        present = None if set(d) == set(layout.names) else tuple(t for t, k in enumerate(layout.names) if k in d)
        vec = np.concatenate([np.asarray(d[k], np.float64).ravel() if k in d else np.zeros(base[k].size)
                              for k in layout.names])
        metrics = u.metrics or {}
        counts = decode_counts(metrics.get("label_counts"), classes) if classes else None
        predicted = decode_predicted(metrics.get("label_predicted"), classes) if classes else None
        ups.append(DenseUpdate(u.device_id, vec, u.weight if u.weight is not None else float(u.num_samples),
                               present, counts, predicted))
    norms = reg.lineage_norm_history(job.model_name, before=(job_id, number))
    evidence = RoundEvidence(layout, history_norm=float(np.median(norms)) if norms else None)
    rule = make_strategy(job.params["aggregator"], strategy_options(RoundPolicy(), job.params), evidence)
    return apply_delta(base, layout.unflatten(rule.reference(ups).vec))


# ---------------------------------------------------------------- the registry on PostgreSQL
# `pytest --pg` (make test-pg) runs every test's coordinator registry on a fresh database of
# one throw-away PostgreSQL cluster (tests/pg_cluster.py): Registry(db=None) reads
# $EDGE_COORDINATOR_DB. Without --pg the variable is cleared: `make test` is SQLite only.
# `@pytest.mark.sqlite_only("why")` marks a test that inspects the SQLite file itself.
def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--pg", action="store_true", help="run the coordinator registry on a throw-away PostgreSQL")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under --pg, tests of the SQLite file itself (marked sqlite_only; each has its PostgreSQL
    counterpart in test_registry_pg.py) are not collected: they do not apply, they are not skipped."""
    if not config.getoption("--pg"):
        return
    sqlite_only = [item for item in items if item.get_closest_marker("sqlite_only") is not None]
    if sqlite_only:
        config.hook.pytest_deselected(items=sqlite_only)
        items[:] = [item for item in items if item.get_closest_marker("sqlite_only") is None]


@pytest.fixture(scope="session")
def pg_cluster():
    from tests.pg_cluster import PgCluster, unavailable

    why = unavailable()
    if why:
        if os.environ.get("CI") == "true":  # .ci/run installs it: a missing install step must not pass as a skip
            pytest.fail(f"PostgreSQL: {why}")
        pytest.skip(f"PostgreSQL: {why}")
    cluster = PgCluster().start()
    yield cluster
    cluster.stop()


@pytest.fixture
def pg_url(pg_cluster):
    """A fresh, empty database of the session's cluster."""
    url = pg_cluster.create_database()
    yield url
    pg_cluster.drop_database(url)


@pytest.fixture
def new_registry_db(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    """Call it before opening a registry that must not share the test's database (a second
    state directory): under --pg it points $EDGE_COORDINATOR_DB at a fresh one."""
    def fresh() -> None:
        if request.config.getoption("--pg"):
            monkeypatch.setenv("EDGE_COORDINATOR_DB", request.getfixturevalue("pg_cluster").create_database())
    return fresh


@pytest.fixture(autouse=True)
def _registry_database(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if not request.config.getoption("--pg"):
        monkeypatch.delenv("EDGE_COORDINATOR_DB", raising=False)
        return
    monkeypatch.setenv("EDGE_COORDINATOR_DB", request.getfixturevalue("pg_url"))
