"""A short run of the agent's parser fuzzer (bench/fuzz_parsers.py; the 10^6-case run is in
`make bench`): every parser judges every generated input with a verdict, never a crash."""

from __future__ import annotations

import json
import random
import time

import pytest

from bench.fuzz_core import Target, fuzz, mutate_bytes, mutate_json
from bench.fuzz_parsers import TARGETS, BundleTarTarget, ManifestTarget
from edge_agent.int8.bundle import ManifestError, parse_manifest
from edge_agent.protocol.finetune import BadParams, parse_finetune

CASES = {"envelope": 3000, "command": 1500, "chunk": 5000, "manifest": 2000, "bundle_tar": 300}


@pytest.fixture(scope="module")
def digits_bundle_dir(tmp_path_factory):
    from edge_agent.sim import scenario as demo

    return demo.ensure_bundle(tmp_path_factory.mktemp("fuzz") / "digits-bundle")


@pytest.mark.parametrize("name", sorted(CASES))  # (the coordinator's handlers: test_coordinator_fuzz.py)
def test_every_generated_input_gets_a_verdict_not_a_crash(name, digits_bundle_dir):
    target = (TARGETS[name](digits_bundle_dir) if name in ("manifest", "bundle_tar") else TARGETS[name]())
    try:
        result = fuzz(target, CASES[name], seed=7)
    finally:
        target.close()
    assert result.cases == CASES[name]
    assert result.crashes == [], result.crashes[:3]
    # the corpus reaches past the first check: some inputs are refused late or accepted
    deep = {v for v in result.verdicts if not v.startswith(("rejected:malformed", "ChunkError", "BundleError"))}
    assert deep, result.verdicts


def test_a_crash_is_recorded_with_its_case_not_raised():
    class Brittle(Target):
        name = "brittle"
        refusals = (ValueError,)

        def case(self, rng: random.Random) -> bytes:
            return rng.randbytes(4)

        def judge(self, data: bytes) -> str:
            if data[0] < 64:
                raise KeyError("undocumented")
            if data[0] < 128:
                raise ValueError("documented refusal")
            return "accepted"

    result = fuzz(Brittle(), 400, seed=1)
    assert result.cases == 400
    assert 0 < len(result.crashes) < 400
    case, error, _ = result.crashes[0]
    assert error.startswith("KeyError") and case >= 0
    assert result.verdicts["ValueError"] > 0 and result.verdicts["accepted"] > 0
    again = fuzz(Brittle(), 400, seed=1)  # the stream is a pure function of (seed, case)
    assert [c for c, _, _ in again.crashes] == [c for c, _, _ in result.crashes]


def test_mutations_are_deterministic_and_do_not_alias():
    a = [mutate_bytes(b"hello world" * 20, random.Random(i), [b"xyz"]) for i in range(50)]
    b = [mutate_bytes(b"hello world" * 20, random.Random(i), [b"xyz"]) for i in range(50)]
    assert a == b and len(set(a)) > 40
    doc = {"a": [1, 2, {"b": "c"}], "d": 3.5}
    outs = [mutate_json(doc, random.Random(i)) for i in range(300)]
    assert doc == {"a": [1, 2, {"b": "c"}], "d": 3.5}  # the seed itself is never changed
    for out in outs:
        json.dumps(out)  # no cycles from shared mutable values


def test_found_by_fuzzing_huge_integers_are_refused_not_crashes(digits_bundle_dir):
    body = {"job": "j", "round": 1, "model": "m", "version": "1", "params": {"epochs": 10**400}}
    with pytest.raises(BadParams, match="epochs"):
        parse_finetune(body, now=time.time())
    manifest = json.loads((digits_bundle_dir / "manifest.json").read_text())
    manifest["input"]["normalisation"]["scale"] = 10**400
    with pytest.raises(ManifestError, match="scale"):
        parse_manifest(json.dumps(manifest).encode())
    manifest["input"]["normalisation"]["scale"] = 1.0
    manifest["input"]["normalisation"]["std"] = [10**400] * len(manifest["input"]["normalisation"]["std"])
    with pytest.raises(ManifestError, match="std"):
        parse_manifest(json.dumps(manifest).encode())


def test_manifest_and_tar_targets_accept_their_own_seed(digits_bundle_dir):
    m = ManifestTarget(digits_bundle_dir)
    assert m.judge(m.raw).startswith("accepted")
    t = BundleTarTarget(digits_bundle_dir)
    try:
        assert all(t.judge(seed) == "accepted" for seed in t.corpus)
    finally:
        t.close()
