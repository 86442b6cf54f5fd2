"""Secure aggregation (SecAgg+; updates/secagg.py, coordinator/secagg.py, sim/secagg.py): real
X25519, ChaCha20-Poly1305, Shamir and Ed25519 throughout -- nothing mocked."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import subprocess
import sys

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.secagg import SecAggRound
from edge_agent.coordinator.strategies.dp import GaussianSum
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes
from edge_agent.sim.secagg import secure_round
from edge_agent.updates.secagg import (
    RoundConfig,
    SecAggDevice,
    SecAggError,
    advert_payload,
    default_degree,
    neighbours,
)

LENGTH = 330  # the digits demo's head: Dense 32 -> 10


def plain_sum(run) -> np.ndarray:
    return (sum(run.quantised[d].astype(np.uint64) for d in run.survivors) % 2**32).astype(np.uint32)


def test_hundred_devices_ten_percent_dropped_after_sharing_gives_the_survivors_sum_and_leaks_no_update(
        tmp_path, caplog):
    caplog.set_level(logging.DEBUG)
    state = tmp_path / "state"
    reg = Registry(state_dir=state)
    head = {"fc_weight": np.zeros((10, 32), np.float32), "fc_bias": np.zeros(10, np.float32)}
    base = reg.add_model_version(name="digits", version="1", head=head)
    dp = GaussianSum(clip=1.0, noise=1.0, denominator=100, rng=lambda: np.random.default_rng(0))
    # fixed device keys and graph seed: SecAgg+ survives a dropout pattern with high probability
    # over the random graph, not always (with fresh keys and seed, one run in CI drew a survivor
    # with 7 of its 14 neighbours among the 10 dropped: below the threshold 8). This graph is
    # checked to be one it survives, so the test is about the protocol, not the draw.
    keys = [Ed25519PrivateKey.from_private_bytes(hashlib.sha256(f"secagg-dev-{i}".encode()).digest())
            for i in range(100)]
    graph_seed = "5e" * 16
    ids = [fingerprint(k) for k in keys]
    dropped = {ids[i] for i in range(0, 100, 10)}
    k = default_degree(100)
    t = k // 2 + 1  # the round's threshold, given below (the simulation's default too)
    graph = neighbours(ids, k, graph_seed)
    assert all(len(set(graph[d]) - dropped) >= t for d in ids if d not in dropped)
    run = secure_round(n=100, length=LENGTH, dp=dp, drop_before_input=range(0, 100, 10), state_dir=state,
                       restart=True, registry=reg, base=(base, head), seed=3, keys=keys, graph_seed=graph_seed,
                       degree=k, threshold=t)
    assert run.error == ""
    assert len(run.survivors) == 90 and run.config.degree < 99  # SecAgg+: a sparse graph
    assert np.array_equal(run.total, plain_sum(run))  # exactly, in the quantised domain
    q = run.config.quantiser
    np.testing.assert_allclose(run.mean, q.decode_sum(plain_sum(run)) / 100)
    new = reg.load_head(run.version)
    delta = np.concatenate([new["fc_weight"].ravel(), new["fc_bias"].ravel()]).astype(np.float64)
    np.testing.assert_allclose(delta, run.mean, atol=1e-6)
    reg.close()

    # the scan: every byte the coordinator wrote (state dir: registry database, heads, the round's
    # state) and every log line; no device's quantised vector or its float form, raw or base64
    blobs = [p.read_bytes() for p in state.rglob("*") if p.is_file()] + [caplog.text.encode()]
    assert any(b"secure round" in b for b in blobs[-1:])  # the logs were captured
    assert (state / "secagg" / "round.json").is_file()
    for did, x in run.quantised.items():
        needles = [x.tobytes(), base64.b64encode(x.tobytes()), x[:8].tobytes(),
                   q.decode_sum(x).astype(np.float32).tobytes()[:32]]
        for blob in blobs:
            for needle in needles:
                assert needle not in blob, did
    # and nothing numeric near one: the stored total (masked or the sum) and the published delta
    stored = json.loads((state / "secagg" / "round.json").read_text())
    total = np.frombuffer(base64.b64decode(stored["total"]), "<u4")
    for did, x in run.quantised.items():
        v = q.decode_sum(x)
        for cand in (q.decode_sum(total), delta):
            assert np.linalg.norm(cand - v) > 0.5 * np.linalg.norm(v), did


def test_below_threshold_fails_naming_why(tmp_path):
    run = secure_round(n=20, length=16, degree=19, threshold=10, drop_before_input=range(11), state_dir=tmp_path)
    assert run.total is None
    assert "9 masked inputs arrived, below the threshold 10" in run.error
    assert SecAggRound.load(tmp_path / "secagg" / "round.json").phase == "failed"


def test_graph_degree_gives_the_documented_tolerance():
    """Each secret needs t of a device's k neighbours: k - t of them may drop, not one more."""
    keys = [generate_private_key() for _ in range(40)]
    ids = [fingerprint(k) for k in keys]
    seed, k, t = "ab" * 16, 8, 5
    graph = neighbours(ids, k, seed)
    assert all(len(v) == k for v in graph.values())
    assert all(a in graph[b] for a in graph for b in graph[a])  # symmetric
    target = sorted(ids)[0]
    near = [ids.index(x) for x in graph[target]]
    ok = secure_round(n=40, length=8, degree=k, threshold=t, keys=keys, graph_seed=seed,
                      drop_before_unmask=near[:k - t])
    assert ok.error == "" and np.array_equal(ok.total, plain_sum(ok))
    bad = secure_round(n=40, length=8, degree=k, threshold=t, keys=keys, graph_seed=seed,
                       drop_before_unmask=near[:k - t + 1])
    assert bad.total is None and f"{t - 1} shares of the self-mask seed of {target}" in bad.error


def test_forged_advertisement_is_refused():
    keys = [generate_private_key() for _ in range(3)]
    cfg = RoundConfig(round_id="j/1", devices=tuple(sorted(fingerprint(k) for k in keys)), degree=2, threshold=1,
                      graph_seed="00" * 16, length=4, clip=1.0)
    dev = {fingerprint(k): SecAggDevice(device_key=k, config=cfg) for k in keys}
    a, b = sorted(dev)[:2]
    coord = SecAggRound(cfg)
    forged = dict(dev[a].advertise())
    forged["s_pk"] = base64.b64encode(b"\1" * 32).decode()  # a key the device did not sign
    with pytest.raises(SecAggError, match="bad signature"):
        coord.receive_advert(a, forged)
    mallory = generate_private_key()  # signs well, but a's id is not its key's fingerprint
    honest = dev[b].advertise()
    raw = [base64.b64decode(honest[f]) for f in ("c_pk", "s_pk", "commit")]
    sig = mallory.sign(advert_payload(cfg.round_id, a, *raw))
    impostor = dict(honest, device=a, key=base64.b64encode(public_key_bytes(mallory)).decode(),
                    sig=base64.b64encode(sig).decode())
    with pytest.raises(SecAggError, match="not that device's"):
        coord.receive_advert(a, impostor)
    with pytest.raises(SecAggError, match="sent by"):
        coord.receive_advert(a, honest)  # b's advertisement replayed as a's


def test_tampered_share_is_refused_by_its_recipient():
    def flip(phase, sender, msg):
        if phase == "inbox" and msg["shares"]:
            j = sorted(msg["shares"])[0]
            raw = bytearray(base64.b64decode(msg["shares"][j]))
            raw[20] ^= 1
            msg = {"shares": {**msg["shares"], j: base64.b64encode(bytes(raw)).decode()}}
        return msg

    run = secure_round(n=6, length=4, degree=5, threshold=3, tamper=flip)
    assert run.total is None and "does not decrypt (tampered or forged)" in run.error


def test_wrong_revealed_share_fails_the_check():
    def lie(phase, sender, msg):
        if phase == "unmask" and msg["b"]:
            j = sorted(msg["b"])[0]
            msg = {"b": {**msg["b"], j: base64.b64encode(b"\7" * 16).decode()}, "sk": msg["sk"]}
        return msg

    run = secure_round(n=6, length=4, degree=5, threshold=5, tamper=lie)
    assert run.total is None and "does not match its commitment" in run.error


def test_never_both_secrets_of_one_device():
    """An answer carrying a key share of a survivor is refused; a device answers only once."""
    keys = [generate_private_key() for _ in range(5)]
    cfg = RoundConfig(round_id="j/2", devices=tuple(sorted(fingerprint(k) for k in keys)), degree=4, threshold=2,
                      graph_seed="11" * 16, length=4, clip=1.0)
    dev = {fingerprint(k): SecAggDevice(device_key=k, config=cfg) for k in keys}
    coord = SecAggRound(cfg)
    for d, x in dev.items():
        coord.receive_advert(d, x.advertise())
    roster = coord.close_advertise()
    for d, x in dev.items():
        coord.receive_shares(d, x.share_keys(roster[d]))
    inbox = coord.close_share()
    ids = sorted(dev)
    for d in ids[1:]:
        coord.receive_masked(d, dev[d].masked_input(inbox[d], np.zeros(4, np.uint32)))
    with pytest.raises(SecAggError, match="masked input"):
        coord.receive_masked(ids[0], b"SAM1" + b"\0" * 3)  # wrong size
    req = coord.close_mask()
    me = ids[1]
    answer = dev[me].unmask(req[me])
    greedy = {"b": answer["b"], "sk": {**answer["sk"], ids[2]: base64.b64encode(b"\0" * 32).decode()}}
    with pytest.raises(SecAggError, match="exactly"):
        coord.receive_unmask(me, greedy)
    with pytest.raises(SecAggError, match="already answered"):
        dev[me].unmask({"survivors": [x for x in req[me]["survivors"] if x != ids[2]],
                        "dropped": sorted([*req[me]["dropped"], ids[2]])})
    with pytest.raises(SecAggError, match="both"):
        dev[ids[2]].unmask({"survivors": [x for x in req[ids[2]]["survivors"] if x != ids[4]], "dropped": [ids[3]]})


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(3, 8).flatmap(lambda n: st.tuples(
    st.just(n), st.integers(1, n - 1), st.sets(st.integers(0, n - 1)), st.sets(st.integers(0, n - 1)))))
def test_any_small_round_gives_the_exact_sum_or_says_why(case):
    n, t, early, late = case
    run = secure_round(n=n, length=5, degree=n - 1, threshold=t, drop_before_input=early,
                       drop_before_unmask=late - early)
    if run.error:
        assert "threshold" in run.error
    else:
        assert len(run.survivors) == n - len(early)
        assert np.array_equal(run.total, plain_sum(run))


def test_the_agent_side_imports_no_shamir_until_a_round():
    code = "import sys, edge_agent.updates.secagg; print(any(m.startswith('Crypto') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_device_that_advertised_before_knowing_the_config_and_restarts_at_every_phase_finishes_the_round():
    """A fleet device advertises with only the round id (the config comes with the roster),
    and is rebuilt from its saved JSON before every step, as an agent restarted mid-round is;
    one device drops after sharing its keys: the sum is the survivors'."""
    keys = [generate_private_key() for _ in range(4)]
    ids = sorted(fingerprint(k) for k in keys)
    by_id = {fingerprint(k): k for k in keys}
    config = RoundConfig(round_id="job-1/1", devices=tuple(ids), degree=3, threshold=2, graph_seed="cd" * 16,
                         length=LENGTH, clip=1.0)
    rng = np.random.default_rng(7)
    xs = {d: config.quantiser.quantise(rng.normal(0, 0.02, LENGTH)) for d in ids}
    saved = {d: json.loads(json.dumps(SecAggDevice(device_key=by_id[d], round_id="job-1/1").to_json())) for d in ids}

    def device(d: str) -> SecAggDevice:
        return SecAggDevice.from_json(saved[d], device_key=by_id[d])

    def step(d: str, fn_name: str, *args):
        dev = device(d)
        out = getattr(dev, fn_name)(*args)
        saved[d] = json.loads(json.dumps(dev.to_json()))
        return out

    coord = SecAggRound(config)
    for d in ids:
        coord.receive_advert(d, step(d, "advertise"))
    roster = coord.close_advertise()
    with pytest.raises(SecAggError, match="config of round"):
        device(ids[0]).share_keys(roster[ids[0]], RoundConfig(**{**config.__dict__, "round_id": "job-1/2"}))
    for d in ids:
        coord.receive_shares(d, step(d, "share_keys", roster[d], config))
    inbox = coord.close_share()
    gone = ids[1]
    for d in ids:
        if d != gone:
            coord.receive_masked(d, step(d, "masked_input", inbox[d], xs[d]))
    request = coord.close_mask()
    for d in request:
        answer = step(d, "unmask", request[d])
        assert device(d).unmask(request[d]) == answer  # asked again after a restart: the same answer
        coord.receive_unmask(d, answer)
    total = coord.close_unmask()
    want = (sum(xs[d].astype(np.uint64) for d in ids if d != gone) % 2**32).astype(np.uint32)
    assert np.array_equal(total, want)
    with pytest.raises(SecAggError, match="c key"):
        SecAggDevice.from_json({**saved[ids[0]], "c": "short"}, device_key=by_id[ids[0]])
