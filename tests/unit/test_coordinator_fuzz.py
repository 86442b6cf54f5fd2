"""A bounded run of the coordinator handler fuzzer (issue 35, item 6; the 10^5-per-kind run is
bench_fuzz): signed hello / state / progress / refusal / update messages, mutated, through
the serving coordinator's verifier (`pending.open`) and its handlers. Every input gets a
verdict: no exception, and no log line with a traceback.

Two generators: the bench's own mutation stream (deterministic per case number, what the
10^5-case run uses), and hypothesis, which draws whole values for a body's fields and its
map entries (integers of any size, floats, nested JSON) and, if one ever crashes, shrinks it
to the smallest body that does. hypothesis was chosen over atheris: it is pure Python (atheris
needs a libFuzzer-instrumented build and runs its own endless loop in-process), already a test
dependency, deterministic with `derandomize`, and bounded by `max_examples`."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.fuzz_coordinator import COORDINATOR_KINDS, CoordinatorHost, CoordinatorTarget
from bench.fuzz_core import fuzz
from edge_agent.protocol import Kind
from edge_agent.protocol.schema import FLAT_ENTRIES, SCHEMAS

CASES = 600  # per kind: a few seconds in all


@pytest.mark.parametrize("kind", COORDINATOR_KINDS)
def test_every_mutated_message_gets_a_verdict_not_a_crash(kind: str) -> None:
    target = CoordinatorTarget(kind)
    try:
        result = fuzz(target, CASES, seed=11)
    finally:
        target.close()
    assert result.cases == CASES
    assert result.crashes == [], result.crashes[:3]
    handled = sum(n for v, n in result.verdicts.items() if v.startswith("handled"))
    assert handled > CASES // 10, result.verdicts  # the stream reaches the handlers, not only the verifier


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    h = CoordinatorHost(tmp_path_factory.mktemp("coord-fuzz"))
    yield h
    h.close()


numbers = st.one_of(st.integers(), st.integers(min_value=2**53 - 2, max_value=2**70), st.floats(allow_nan=False))
hostile = st.sampled_from([10**400, -(10**400), 2**64, -(2**63) - 1, 1e308])
scalars = st.one_of(st.none(), st.booleans(), numbers, st.text(max_size=300))
values = st.one_of(hostile, numbers, st.recursive(scalars, lambda inner: st.lists(inner, max_size=3)
                                         | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=6))
MAP_FIELDS = ("info", "metrics")
KINDS = {k: Kind.UPDATE_CHUNK if k == "update" else Kind(k) for k in COORDINATOR_KINDS}


@pytest.mark.parametrize("kind", COORDINATOR_KINDS)
@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_values_in_a_signed_body_are_refused_or_handled(host, kind: str, data: Any) -> None:
    """The approved device's real key signs a seed body with one field, or one entry of its
    info/metrics map, replaced by a drawn value: the verifier refuses it or the handler takes it."""
    if kind == "update":
        body, payload = host.update_seeds()[0]
        body = dict(body)
    else:
        body, payload = host.seed_body(kind, random.Random(data.draw(st.integers(0, 9)))), None
    name = data.draw(st.sampled_from(sorted(SCHEMAS[KINDS[kind]]) + ["unknown"]))  # one field: the rest stay
    if name in MAP_FIELDS and isinstance(body.get(name), dict) and data.draw(st.booleans()):  # valid, so the
        entry = data.draw(st.sampled_from([*FLAT_ENTRIES, *body[name], "other"]))  # drawn value is what is judged
        body[name] = {**body[name], entry: data.draw(values)}
    else:
        body[name] = data.draw(values)
    topic = host.topic(kind, host.dkey)
    sealed = host.seal(topic, host.envelope(kind, body, host.dkey), host.dkey, payload)
    if sealed is None:  # not encodable as JSON: no sender could send it
        return
    verdict = host.feed(topic, sealed)  # raises: a crash (or a traceback in the log)
    assert verdict.startswith(("rejected:", "handled:")), verdict
