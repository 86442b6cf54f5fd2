"""A secure job's device side (agent/secure.py) against the real coordinator state machine:
the round secrets on disk (0600), a daemon restarted before every step going on with the same
answers, the secrets deleted once revealed, and a round that ends without the device."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edge_agent.agent.jobs import Job
from edge_agent.agent.secure import STATE_DIR, SecureJobs
from edge_agent.coordinator.secagg import SecAggRound
from edge_agent.coordinator.secure_rounds import SecureRounds
from edge_agent.keys import fingerprint, generate_private_key
from edge_agent.protocol import Kind, Message, Topics, check_body
from edge_agent.updates.secagg import RoundConfig

JOB, T0 = "job-abc", 1_700_000_000.0
TOPICS = Topics(fleet="farm", prefix="test/edgeft/v1")


class Device:
    def __init__(self, root: Path, i: int, length: int = 12) -> None:
        self.key = generate_private_key()
        self.id = fingerprint(self.key)
        self.dir = root / f"dev{i}"
        (self.dir / "debug" / "secagg_inputs").mkdir(parents=True)  # test hook: keep the masked input
        self.sent: list[tuple[Kind, dict[str, Any]]] = []
        self.finished: list[tuple[str, bool, str]] = []
        self.now = T0
        self.delta = np.random.default_rng(i).normal(0, 0.01, length)
        self.job = Job(job_id=f"{JOB}-r1", round=1, model="digits@1",
                       params={"job": JOB, "deadline_at": T0 + 100, "secagg": True, "secagg_phase_s": 10.0})
        self.restart()

    def restart(self) -> None:
        """A new daemon on the same state dir."""
        self.jobs = SecureJobs(state_dir=self.dir, key=self.key, hooks=True, clock=lambda: self.now,
                               send=lambda kind, body: self.sent.append((kind, body)) or True,
                               finish=lambda job, ok, why: self.finished.append((job, ok, why)))

    def deliver(self, kind: Kind, body: dict[str, Any]) -> list[tuple[Kind, dict[str, Any]]]:
        """-> what the device sent in answer (a masked input: one message, or its chunks)."""
        check_body(kind, body)
        topic = TOPICS.device(self.id, "secagg_cmd")
        before = len(self.sent)
        self.jobs.handle(Message(kind, TOPICS.parse(topic), "coordinator", 1, int(T0), int(T0) + 60, body))
        return self.sent[before:]

    @property
    def state_file(self) -> Path:
        return self.dir / STATE_DIR / f"{JOB}-r1.json"


@pytest.fixture
def devices(tmp_path: Path, request: pytest.FixtureRequest) -> list[Device]:
    return [Device(tmp_path, i, getattr(request, "param", 12)) for i in range(3)]


def masked_input(answer: list[tuple[Kind, dict[str, Any]]]) -> bytes:
    """A masked input from its messages, as the coordinator reassembles it (secure_chunks.py)."""
    if len(answer) == 1 and "chunks" not in answer[0][1]:
        return base64.b64decode(answer[0][1]["masked"])
    bodies = [b for _, b in answer]
    assert [b["chunk"] for b in bodies] == list(range(len(bodies))) and {b["chunks"] for b in bodies} == {len(bodies)}
    whole = b"".join(base64.b64decode(b["masked"]) for b in bodies)
    assert {b["sha256"] for b in bodies} == {hashlib.sha256(whole).hexdigest()}
    return whole


def coordinator_requests(r: SecAggRound) -> dict[str, tuple[Kind, dict[str, Any]]]:
    return {d: SecureRounds.request(r, d) for d in SecureRounds._waiting(r)}


@pytest.mark.parametrize("devices", [12, 40_000], indirect=True)  # 40,000: a masked input in 3 chunks
def test_a_device_restarted_before_every_step_finishes_the_round_and_forgets_its_secrets(devices) -> None:
    ids = sorted(d.id for d in devices)
    by_id = {d.id: d for d in devices}
    length = devices[0].delta.size
    r = SecAggRound(RoundConfig(round_id=f"{JOB}/1", devices=tuple(ids), degree=2, threshold=2,
                                graph_seed="ab" * 16, length=length, clip=1.0))
    for d in devices:
        d.jobs.begin(d.job, d.delta.astype("<f8").tobytes())
        kind, body = d.sent[-1]
        assert kind is Kind.SECAGG_ADVERT
        check_body(kind, body)
        assert d.state_file.stat().st_mode & 0o777 == 0o600
        assert {"device", "delta"} <= set(json.loads(d.state_file.read_text()))
        r.receive_advert(d.id, body["advert"])
        d.jobs.begin(d.job, b"")  # begun again (a restart before the job's record said so): nothing changes
        assert len(d.sent) == 1
    r.close_advertise()
    receive = {Kind.SECAGG_SHARES: lambda d, a: r.receive_shares(d, {"shares": a[0][1]["shares"]}),
               Kind.SECAGG_MASKED: lambda d, a: r.receive_masked(d, masked_input(a)),
               Kind.SECAGG_REVEAL: lambda d, a: r.receive_unmask(d, {"b": a[0][1]["b"], "sk": a[0][1]["sk"]})}
    closes = [r.close_share, r.close_mask, lambda: None]
    for close in closes:
        for did, (kind, body) in coordinator_requests(r).items():
            dev = by_id[did]
            dev.restart()
            answer = dev.deliver(kind, body)
            masking = answer[0][0] is Kind.SECAGG_MASKED
            assert len(answer) == (3 if masking and length > 16_384 else 1)
            dev.restart()
            dev.jobs.recover()  # after a restart: its last message (every chunk) again, the same
            assert dev.sent[-len(answer):] == answer
            assert dev.deliver(kind, body) == answer  # asked again: the same answer, all its chunks
            for message in answer:
                check_body(*message)
            receive[answer[0][0]](did, answer)
        close()
    total = r.close_unmask()
    inputs = [np.frombuffer((d.dir / "debug" / "secagg_inputs" / f"{JOB}-r1.u32").read_bytes(), "<u4")
              for d in devices]
    assert np.array_equal(total, (sum(x.astype(np.uint64) for x in inputs) % 2**32).astype(np.uint32))
    for d in devices:
        assert d.finished == [(f"{JOB}-r1", True, "secure aggregation: masked input sent and shares revealed")]
        kept = json.loads(d.state_file.read_text())
        assert kept["done"] is True and not {"device", "delta"} & set(kept)  # the secrets are gone
        d.now = T0 + 1000
        d.jobs.step()  # the round's end: the reveal goes too, the job stays done
        assert not d.state_file.exists() and len(d.finished) == 1


def test_a_round_that_ends_without_the_device_fails_its_job_and_deletes_its_secrets(devices) -> None:
    d = devices[0]
    d.jobs.begin(d.job, d.delta.astype("<f8").tobytes())
    d.now = T0 + 100 + 4 * 10 + 59
    d.jobs.step()
    assert d.state_file.exists() and d.finished == []
    d.now += 2
    d.jobs.step()
    assert not d.state_file.exists()
    assert d.finished == [(f"{JOB}-r1", False, "secure round ended without this device (no unmask request before "
                                               "its deadline)")]


def test_a_request_for_a_round_the_device_is_not_in_or_a_damaged_state_file_is_survived(devices) -> None:
    d = devices[0]
    topic = TOPICS.device(d.id, "secagg_cmd")
    body = {"job": JOB, "round": 1, "survivors": [d.id], "dropped": []}
    d.jobs.handle(Message(Kind.SECAGG_UNMASK, TOPICS.parse(topic), "coordinator", 1, int(T0), int(T0) + 60, body))
    assert d.sent == []  # a round it is not in: nothing revealed, nothing raised
    d.jobs.begin(d.job, d.delta.astype("<f8").tobytes())
    d.state_file.write_text("{not json")
    d.restart()
    d.jobs.recover()  # logged, removed: the round goes on without this device
    assert not d.state_file.exists()
    d.jobs.begin(d.job, d.delta.astype("<f8").tobytes())
    d.state_file.write_bytes(b"\0" * 64)  # zero-filled by a power cut: a request finds it so
    d.jobs.handle(Message(Kind.SECAGG_UNMASK, TOPICS.parse(topic), "coordinator", 2, int(T0), int(T0) + 60, body))
    assert not d.state_file.exists() and d.finished[-1][:2] == (f"{JOB}-r1", False)
