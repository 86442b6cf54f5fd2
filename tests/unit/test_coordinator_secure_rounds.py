"""Secure jobs through the round engine without a broker (coordinator/secure_rounds.py): real
registry files, real SecAgg+ devices (updates/secagg.py) answering the engine's requests as
the agent does, a coordinator restarted between every phase, per-phase deadlines."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from edge_agent.coordinator.privacy import PrivacyLedger
from edge_agent.coordinator.records import JobStatus, ParticipantStatus, RoundState
from edge_agent.coordinator.registry import Registry
from edge_agent.coordinator.rounds import RoundEngine
from edge_agent.coordinator.secure_chunks import PendingInputs
from edge_agent.coordinator.secure_rounds import RESEND_S, STATE_DIR
from edge_agent.errors import InputError
from edge_agent.keys import fingerprint, generate_private_key, public_key_bytes
from edge_agent.protocol import Kind
from edge_agent.protocol.schema import SECAGG_MAX_LENGTH, check_body, masked_chunks
from edge_agent.updates.secagg import (
    RoundConfig,
    SecAggDevice,
    clip_and_noise,
    flat_by_name,
    unflat_by_name,
)

T0 = 1_700_000_000.0
HEAD = {"dense0_weight": np.linspace(-0.1, 0.1, 40, dtype=np.float32).reshape(4, 10),
        "dense0_bias": np.zeros(4, np.float32)}


class Clock:
    def __init__(self) -> None:
        self.t = T0

    def __call__(self) -> float:
        return self.t


class Fleet:
    """A registry and engine (reopened as a restarted coordinator would be) and N devices."""

    def __init__(self, state_dir: Path, n: int, *, secagg: bool = True, head: dict | None = None) -> None:
        self.dir, self.clock = state_dir, Clock()
        self.keys = [generate_private_key() for _ in range(n)]
        self.ids = [fingerprint(k) for k in self.keys]
        self.head = HEAD if head is None else head
        self.open()
        self.reg.add_model_version(name="digits", version="1", head=self.head)
        for key, did in zip(self.keys, self.ids, strict=True):
            self.reg.enrol_device(device_id=did, public_key=base64.b64encode(public_key_bytes(key)).decode(),
                                  fleet="farm", board="rpi4", approved=True)
            self.reg.record_state(did, online=True, state={"battery_pct": 90.0, "on_power": True,
                                                          **({"secagg": True} if secagg else {})})
        self.devices: dict[str, SecAggDevice] = {}
        self.deltas = {d: {n: np.random.default_rng(i).normal(0, 0.01, a.shape) for n, a in self.head.items()}
                       for i, d in enumerate(self.ids)}
        self.inputs: dict[str, np.ndarray] = {}

    def open(self) -> None:
        self.reg = Registry(state_dir=self.dir, clock=self.clock)
        self.engine = RoundEngine(registry=self.reg, clock=self.clock)

    def restart(self) -> None:
        self.reg.close()
        self.open()

    def send(self, device: str, kind: Kind, body: dict) -> bool:
        check_body(kind, body)  # what the agent sends is what the protocol takes
        return self.engine.receive_secagg(body["job"], body["round"], device, kind, body)

    def answer(self, device: str, kind: Kind, body: dict) -> tuple[Kind, dict]:
        """What agent/secure.py answers to a request (the device's side, in memory)."""
        check_body(kind, body)
        dev, head = self.devices[device], {"job": body["job"], "round": body["round"]}
        if kind is Kind.SECAGG_ROSTER:
            config = RoundConfig.from_json(body["config"])
            return Kind.SECAGG_SHARES, {**head, **dev.share_keys(body, config)}
        if kind is Kind.SECAGG_INBOX:
            c = dev.config
            x = c.quantiser.quantise(clip_and_noise(flat_by_name(self.deltas[device]), c.clip, c.noise_std))
            self.inputs[device] = x
            return Kind.SECAGG_MASKED, {**head, "masked": base64.b64encode(dev.masked_input(body, x)).decode()}
        return Kind.SECAGG_REVEAL, {**head, **dev.unmask(body)}


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    return Fleet(tmp_path / "coordinator", 4)


def start(f: Fleet, **params) -> str:
    job = f.engine.start_job(model_name="digits", model_version="1", rounds=1, min_devices=3, deadline_s=100,
                             params={"secagg": True, "secagg_phase_s": 30, **params})
    (plan,) = f.engine.tick().opened
    f.engine.record_dispatches(job.id, 1, dict.fromkeys(plan.devices))
    assert plan.params["secagg"] is True
    return job.id


@pytest.mark.parametrize("silent_after", [Kind.SECAGG_SHARES, Kind.SECAGG_MASKED])
def test_a_secure_round_with_a_restart_before_every_phase_and_a_silent_device_publishes_the_survivors_mean(
        fleet: Fleet, silent_after: Kind) -> None:
    """Silent after its shares: its masks are removed through its reconstructed key, the
    mask phase closes at its deadline, the mean is the other three's. Silent after its masked
    input: its input counts (it is a survivor), the unmask phase closes as soon as every
    secret has its threshold of shares -- no deadline waited for."""
    f = fleet
    job = start(f)
    assert f.reg.get_job(job).params["aggregator"] == "fedavg"
    for key, did in zip(f.keys, f.ids, strict=True):  # trained: each advertises
        f.devices[did] = SecAggDevice(device_key=key, round_id=f"{job}/1")
        assert f.send(did, Kind.SECAGG_ADVERT, {"job": job, "round": 1, "advert": f.devices[did].advertise()})
    assert f.reg.get_round(job, 1).participants[f.ids[0]].status is ParticipantStatus.DISPATCHED  # (until done)
    silent = f.ids[2]
    answered: dict[Kind, int] = {}
    said: dict[str, list[Kind]] = {d: [] for d in f.ids}
    for _ in range(8):  # phases: share, mask (closed by its deadline), unmask
        f.restart()
        result = f.engine.tick()
        if result.closed:
            break
        for device, kind, body in result.secagg:
            if device == silent and silent_after in said[device]:
                continue
            reply_kind, reply = f.answer(device, kind, body)
            assert f.send(device, reply_kind, reply)
            assert not f.send(device, reply_kind, reply)  # a resend (after an agent restart) changes nothing
            answered[reply_kind] = answered.get(reply_kind, 0) + 1
            said[device].append(reply_kind)
        if kind is Kind.SECAGG_INBOX and silent_after is Kind.SECAGG_SHARES:
            f.clock.t += 31  # the silent device's masked input never comes: the phase's deadline closes it
    (outcome,) = result.closed
    assert outcome.state is RoundState.AGGREGATED, outcome.reason
    masked = 3 if silent_after is Kind.SECAGG_SHARES else 4
    assert answered == {Kind.SECAGG_SHARES: 4, Kind.SECAGG_MASKED: masked, Kind.SECAGG_REVEAL: 3}
    assert f.clock.t == (T0 + 31 if silent_after is Kind.SECAGG_SHARES else T0)
    path = f.dir / STATE_DIR / f"{job}-r1.json"
    assert path.stat().st_mode & 0o777 == 0o600
    state = json.loads(path.read_text())
    assert state["round"]["dropped"] == ([silent] if masked == 3 else [])
    assert len(f.inputs) == masked
    total = (sum(x.astype(np.uint64) for x in f.inputs.values()) % 2**32).astype(np.uint32)
    assert np.array_equal(np.frombuffer(base64.b64decode(state["sum"]), "<u4"), total)
    q = RoundConfig.from_json(state["round"]["config"]).quantiser
    mean = unflat_by_name(q.decode_sum(total) / masked, {n: a.shape for n, a in HEAD.items()})
    new = f.reg.load_head(outcome.new_version)
    for name, arr in HEAD.items():
        np.testing.assert_allclose(new[name], arr + mean[name].astype(np.float32), rtol=0, atol=1e-7)
    assert outcome.new_version.metrics["secagg_survivors"] == masked and f.reg.list_updates(job, 1) == []
    assert f.reg.get_job(job).status is JobStatus.DONE
    parts = f.reg.get_round(job, 1).participants
    if masked == 3:  # the silent device is the round's dropout, saying when it left
        assert outcome.dropouts == {silent: "secagg: no masked input after sharing its keys"}
        assert {d: p.status for d, p in parts.items() if d != silent} == dict.fromkeys(
            set(f.ids) - {silent}, ParticipantStatus.REPORTED)
    else:  # its input is in the sum: it reported
        assert outcome.dropouts == {} and all(p.status is ParticipantStatus.REPORTED for p in parts.values())


def chunked(body: dict) -> list[dict]:
    """A masked input's messages, as agent/secure.py sends them."""
    data = base64.b64decode(body["masked"])
    parts = masked_chunks(data)
    digest = hashlib.sha256(data).hexdigest()
    return [{**body, "masked": base64.b64encode(p).decode(), "chunk": i, "chunks": len(parts), "sha256": digest}
            for i, p in enumerate(parts)]


BIG = {"w": np.linspace(-0.1, 0.1, 40_000, dtype=np.float32).reshape(200, 200), "b": np.zeros(8, np.float32)}


def test_a_head_over_one_message_s_worth_goes_through_in_chunks_and_a_half_sent_input_is_left_out(
        tmp_path: Path) -> None:
    """40,008 parameters (over the one-message 16,384): each masked input is 3 chunks, the
    coordinator restarted after every chunk. One device sends chunk 0 and goes silent: it is
    not in U2 and the sum is still exact. Another sends chunks 0 and 2, is asked again and
    resends all three: the duplicates are ignored, the missing one completes its input."""
    f = Fleet(tmp_path / "c", 4, head=BIG)
    job = start(f)
    for key, did in zip(f.keys, f.ids, strict=True):
        f.devices[did] = SecAggDevice(device_key=key, round_id=f"{job}/1")
        assert f.send(did, Kind.SECAGG_ADVERT, {"job": job, "round": 1, "advert": f.devices[did].advertise()})
    half, late = f.ids[1], f.ids[3]
    pending = f.dir / STATE_DIR / f"{job}-r1.chunks"
    inboxes, stored = 0, {}
    for _ in range(10):
        result = f.engine.tick()
        if result.closed:
            break
        for device, kind, body in result.secagg:
            if (device, kind) in stored:  # asked again: the stored answer (agent/secure.py)
                reply_kind, reply = stored[(device, kind)]
            else:
                reply_kind, reply = stored[(device, kind)] = f.answer(device, kind, body)
            if reply_kind is not Kind.SECAGG_MASKED:
                assert f.send(device, reply_kind, reply)
                continue
            parts = chunked(reply)
            assert len(parts) == 3
            if device == half:
                if inboxes == 0:
                    assert f.send(device, reply_kind, parts[0])  # then silent
                continue
            if device == late and inboxes == 0:
                assert f.send(device, reply_kind, parts[0]) and f.send(device, reply_kind, parts[2])
                continue
            for part in parts:
                new = device != late or part["chunk"] == 1
                assert f.send(device, reply_kind, part) is new  # (late's 0 and 2: duplicates)
                assert not f.send(device, reply_kind, part)  # a chunk again: ignored
                f.restart()  # the coordinator restarted between chunks: they are on disk
            assert not (pending / device).exists()  # folded into the sum: its chunks are gone
            assert not f.send(device, reply_kind, parts[0])  # its input is in the sum already
        if kind is Kind.SECAGG_INBOX:
            inboxes += 1
            if inboxes == 1:  # late and half still owe chunks: asked again
                assert sorted(p.name for p in pending.iterdir()) == sorted([half, late])
                assert all(p.stat().st_mode & 0o777 == 0o600 for p in (pending / half).iterdir())
                f.clock.t += RESEND_S
                late_parts = chunked(stored[(late, Kind.SECAGG_INBOX)][1])
                assert not f.send(late, Kind.SECAGG_MASKED, late_parts[0])  # still sending (a duplicate)...
                assert [d for d, *_ in f.engine.tick().secagg] == [half]  # ...so not asked for them all again
                f.clock.t += RESEND_S
            else:
                assert [p.name for p in pending.iterdir()] == [half]
                f.clock.t += 31  # half never completes: the mask phase's deadline
    (outcome,) = result.closed
    assert outcome.state is RoundState.AGGREGATED, outcome.reason
    assert inboxes == 2 and not pending.exists()  # the round ended: the partial input went too
    state = json.loads((f.dir / STATE_DIR / f"{job}-r1.json").read_text())
    assert state["round"]["dropped"] == [half] and half not in state["round"]["survivors"]
    del f.inputs[half]
    total = (sum(x.astype(np.uint64) for x in f.inputs.values()) % 2**32).astype(np.uint32)
    assert np.array_equal(np.frombuffer(base64.b64decode(state["sum"]), "<u4"), total)
    q = RoundConfig.from_json(state["round"]["config"]).quantiser
    mean = unflat_by_name(q.decode_sum(total) / 3, {n: a.shape for n, a in BIG.items()})
    new = f.reg.load_head(outcome.new_version)
    for name, arr in BIG.items():
        np.testing.assert_allclose(new[name], arr + mean[name].astype(np.float32), rtol=0, atol=1e-7)
    assert outcome.dropouts == {half: "secagg: no masked input after sharing its keys"}


def test_pending_chunks_are_checked_against_their_hash_and_bounded(tmp_path: Path) -> None:
    total = 2 * 65_536 + 4
    data = bytes(range(256)) * (total // 256) + bytes(total % 256)
    parts, digest = masked_chunks(data), hashlib.sha256(data).hexdigest()
    p = PendingInputs(tmp_path / "r", budget=total)  # one device's input at a time
    assert p.add("a", total, 0, 3, digest, parts[0]) == (None, True)
    with pytest.raises(InputError, match="1 devices' partial masked inputs are held"):
        p.add("b", total, 0, 3, digest, parts[0])  # over the budget: sent again later
    with pytest.raises(InputError, match="sha256 differs"):
        p.add("a", total, 1, 3, "0" * 64, parts[1])
    with pytest.raises(InputError, match="chunk 1 of this round's input is 65536 bytes"):
        p.add("a", total, 1, 3, digest, parts[1][:-4])
    with pytest.raises(InputError, match="input is 3 messages, got 2"):
        p.add("a", total, 1, 2, digest, parts[1])
    assert p.add("a", total, 1, 3, digest, parts[1]) == (None, True)
    assert p.add("a", total, 2, 3, digest, parts[2]) == (data, True)
    p.drop("a")
    assert p.add("b", total, 0, 3, digest, parts[0]) == (None, True)  # a slot again
    p.drop("b")
    bad = hashlib.sha256(b"other").hexdigest()  # chunks that do not hash to what they claim
    for i in (0, 1):
        assert p.add("c", total, i, 3, bad, parts[i]) == (None, True)
    with pytest.raises(InputError, match="does not match the reassembled"):
        p.add("c", total, 2, 3, bad, parts[2])
    assert not (tmp_path / "r" / "c").exists()  # dropped: the device may send again
    p.clear()
    assert not (tmp_path / "r").exists()


def test_a_private_secure_job_is_charged_to_its_ledger_and_each_device_adds_its_noise_share(fleet: Fleet) -> None:
    f = fleet
    job = start(f, dp_clip=1.0, dp_noise=1.0)
    assert f.reg.get_job(job).params["aggregator"] == "dp_fedavg"
    assert PrivacyLedger(f.dir).rates(job, upto=1)  # charged before the round opened
    for key, did in zip(f.keys, f.ids, strict=True):
        f.devices[did] = SecAggDevice(device_key=key, round_id=f"{job}/1")
        f.send(did, Kind.SECAGG_ADVERT, {"job": job, "round": 1, "advert": f.devices[did].advertise()})
    for _ in range(6):
        result = f.engine.tick()
        if result.closed:
            break
        for device, kind, body in result.secagg:
            assert f.send(device, *f.answer(device, kind, body))
    (outcome,) = result.closed
    assert outcome.state is RoundState.AGGREGATED, outcome.reason
    config = f.devices[f.ids[0]].config
    # sigma C / sqrt(3): the share of the 3 inputs the round may release with (4 selected, 1 may drop)
    assert config.clip == 1.0 and config.noise_std == pytest.approx(1.0 / np.sqrt(3))
    assert outcome.new_version.metrics["aggregator"] == "dp_fedavg" and "dp_epsilon" in outcome.new_version.metrics


def test_a_private_secure_round_with_fewer_inputs_than_its_noise_was_planned_for_is_never_unmasked(
        tmp_path: Path) -> None:
    """5 devices, --min-devices 3: each adds the noise share of 4 inputs (1 may drop). Two go
    silent after sharing their keys: the 3 masked inputs would carry 3/4 of the noise the
    ledger charged for, so the round fails before anyone is asked to unmask, saying why."""
    f = Fleet(tmp_path / "coordinator", 5)
    job = start(f, dp_clip=1.0, dp_noise=1.0)
    for key, did in zip(f.keys, f.ids, strict=True):
        f.devices[did] = SecAggDevice(device_key=key, round_id=f"{job}/1")
        f.send(did, Kind.SECAGG_ADVERT, {"job": job, "round": 1, "advert": f.devices[did].advertise()})
    silent = set(f.ids[:2])
    asked: list[Kind] = []
    for _ in range(8):
        result = f.engine.tick()
        if result.closed:
            break
        for device, kind, body in result.secagg:
            asked.append(kind)
            reply_kind, reply = f.answer(device, kind, body)
            if device in silent and reply_kind is Kind.SECAGG_MASKED:
                continue
            assert f.send(device, reply_kind, reply)
        f.clock.t += 31  # the silent devices' masked inputs never come: the mask phase's deadline closes it
    (outcome,) = result.closed
    assert f.devices[f.ids[0]].config.noise_std == pytest.approx(1.0 / 2)  # sigma C / sqrt(4)
    assert outcome.state is not RoundState.AGGREGATED and outcome.new_version is None
    assert "fewer than the 4 each device's noise share was planned for" in outcome.reason, outcome.reason
    assert Kind.SECAGG_UNMASK not in asked  # nobody was asked to reveal anything
    state = json.loads((f.dir / STATE_DIR / f"{job}-r1.json").read_text())
    assert state.get("sum") is None and state["round"]["phase"] == "failed"


@pytest.mark.parametrize(("params", "min_devices", "why"), [
    ({"mode": "async", "buffer": 4, "max_staleness": 2}, 3, "cannot be asynchronous"),
    ({"aggregator": "median"}, 3, "which needs each update"),
    ({}, 2, "min-devices >= 3"),
    ({"dp_clip": 1.0, "dp_noise": 1.0, "secagg_clip": 2.0}, 3, "clips to --dp-clip"),
    ({"secagg_phase_s": 0.1}, 3, "secagg_phase_s must be"),
    ({"devices_per_round": 2001}, 3, "at most 2000 devices"),
])
def test_a_secure_job_that_cannot_work_is_refused_saying_why(fleet: Fleet, params: dict, min_devices: int,
                                                              why: str) -> None:
    with pytest.raises(InputError, match=why):
        fleet.engine.start_job(model_name="digits", model_version="1", min_devices=min_devices,
                               params={"secagg": True, **params})


def test_a_head_over_the_secure_limit_is_refused(fleet: Fleet) -> None:
    fleet.reg.add_model_version(name="big", version="1", head={"w": np.zeros(SECAGG_MAX_LENGTH + 1, np.float32)})
    with pytest.raises(InputError, match="at most 1048576 parameters"):
        fleet.engine.start_job(model_name="big", model_version="1", min_devices=3, params={"secagg": True})


def test_devices_whose_hello_does_not_say_secagg_are_not_selected(tmp_path: Path) -> None:
    f = Fleet(tmp_path / "c", 4, secagg=False)
    job = f.engine.start_job(model_name="digits", model_version="1", min_devices=3, deadline_s=100,
                             params={"secagg": True})
    assert f.engine.tick().opened == []
    assert "does not do secure aggregation" in f.reg.get_job(job.id).reason


def test_a_message_for_a_round_that_is_not_a_secure_one_is_refused(fleet: Fleet) -> None:
    job = fleet.engine.start_job(model_name="digits", model_version="1", min_devices=3, deadline_s=100)
    plan = fleet.engine.tick().opened[0]
    fleet.engine.record_dispatches(job.id, 1, dict.fromkeys(plan.devices))
    dev = SecAggDevice(device_key=fleet.keys[0], round_id=f"{job.id}/1")
    with pytest.raises(InputError, match="not an open secure round"):
        fleet.send(fleet.ids[0], Kind.SECAGG_ADVERT, {"job": job.id, "round": 1, "advert": dev.advertise()})


def test_train_secure_aggregation_queues_a_secure_job_and_refuses_what_cannot_work(capsys, fleet: Fleet) -> None:
    from edge_agent.coordinator.cli import main
    from edge_agent.errors import EXIT_USAGE

    fleet.reg.add_model_version(name="big", version="1", head={"w": np.zeros(SECAGG_MAX_LENGTH + 1, np.float32)})
    fleet.reg.close()

    def run(*argv: str) -> tuple[int, str]:
        code = main(["train", "--model", "digits", "--detach", *argv, "--state-dir", str(fleet.dir)])
        return code, capsys.readouterr().err

    rc, err = run("--secure-aggregation", "--min-devices", "3", "--secagg-phase", "45s", "--wait-for-devices")
    assert rc == 0, err
    with Registry(state_dir=fleet.dir) as reg:
        (job,) = reg.list_jobs()
    assert job.params["secagg"] is True and job.params["secagg_phase_s"] == 45.0 and job.params["aggregator"] == "fedavg"
    for argv, why in ((("--min-devices", "3", "--async"), "cannot be asynchronous"),
                      (("--min-devices", "3", "--aggregator", "trimmed_mean"), "which needs each update"),
                      ((), "min-devices >= 3")):
        rc, err = run("--secure-aggregation", *argv)
        assert rc == EXIT_USAGE and why in err, err
    rc, err = run("--secure-aggregation", "--min-devices", "3", "--wait-for-devices", "--model", "big")  # (last counts)
    assert rc != 0 and "a secure job's head has at most 1048576 parameters" in err, err
    rc, err = run("--secagg-phase", "10")
    assert rc == EXIT_USAGE and "option of --secure-aggregation" in err


def test_two_serve_workers_on_one_state_dir_never_overwrite_each_other_s_messages(fleet: Fleet) -> None:
    """Whichever worker takes a device's message (a shared subscription), the round's state
    holds them all: each reads what the other wrote before changing it (flock + re-read)."""
    f = fleet
    job = start(f)
    other = RoundEngine(registry=Registry(state_dir=f.dir, clock=f.clock), clock=f.clock)
    for i, (key, did) in enumerate(zip(f.keys, f.ids, strict=True)):
        f.devices[did] = SecAggDevice(device_key=key, round_id=f"{job}/1")
        engine = f.engine if i % 2 else other
        assert engine.receive_secagg(job, 1, did, Kind.SECAGG_ADVERT,
                                     {"job": job, "round": 1, "advert": f.devices[did].advertise()})
    rosters = f.engine.tick().secagg  # everyone advertised: the share phase opens at once, for all four
    assert sorted(d for d, kind, _ in rosters if kind is Kind.SECAGG_ROSTER) == sorted(f.ids)
    for i, (device, kind, body) in enumerate(rosters):
        engine = other if i % 2 else f.engine
        assert engine.receive_secagg(job, 1, device, *f.answer(device, kind, body))
    state = json.loads((f.dir / STATE_DIR / f"{job}-r1.json").read_text())
    assert sorted(state["round"]["shares"]) == sorted(f.ids)
