"""Fuzz targets for the coordinator's handlers of what devices send (bench/fuzz_parsers.py
lists them with the device-side parsers): a serving `Coordinator` with no broker fed signed
device messages of one kind, their bodies mutated.
"""

from __future__ import annotations

import base64
import logging
import random
import shutil
import time
from pathlib import Path
from typing import Any

from bench.fuzz_core import Target, mutate_bytes, mutate_json, scratch

COORDINATOR_KINDS = ("hello", "state", "progress", "refusal", "update")


class CoordinatorHost:
    """A serving `Coordinator` with no broker (its publishes and acks fail fast, as when
    disconnected): one approved device selected for round 1 of a running job, and one device
    pending approval. `feed(topic, payload)` is what the serve loop does with a message:
    `pending.open` (the channel's verifier) then `handle`, so an exception escapes (a crash
    to the fuzzer); and any log record carrying a traceback is one too (`tracebacks`)."""

    FLEET, PREFIX = "fuzz", "fuzz/edgeft/v1"

    def __init__(self, root: Path) -> None:
        import logging

        import numpy as np

        from edge_agent import keys
        from edge_agent.config import public_key_text
        from edge_agent.coordinator.service import Coordinator, ServeOptions

        self.root = root
        self.coord = c = Coordinator(ServeOptions(state_dir=root / "coord", fleet=self.FLEET, topic_prefix=self.PREFIX))
        self.topics = c.topics
        self.dkey, self.pkey, self.rogue = (keys.generate_private_key() for _ in range(3))
        self.dev, self.pending_dev = keys.fingerprint(self.dkey), keys.fingerprint(self.pkey)
        rng = np.random.default_rng(0)
        self.head = {"dense0_weight": (rng.standard_normal((10, 16)) * 0.01).astype(np.float32),
                     "dense0_bias": np.zeros(10, np.float32)}
        reg = c.registry
        reg.add_model_version(name="digits", version="1", head=self.head, bundle_path=str(root / "no-bundle"))
        for key, approved in ((self.dkey, True), (self.pkey, False)):
            reg.enrol_device(device_id=keys.fingerprint(key), public_key=public_key_text(key), fleet=self.FLEET,
                             board="fuzz board", approved=approved)
            reg.record_state(keys.fingerprint(key), online=True, state={"battery_pct": 90, "on_power": False})
        c.device_trust.sync()  # noqa: SLF001 - what serve's tick does after an approval
        # The registry keeps one battery/power sample per device a minute: its clock moves a
        # minute per case, so every state's readings reach the history table.
        self._minutes = 0
        c.registry._clock = lambda: time.time() + 61.0 * self._minutes  # noqa: SLF001
        c.pending.sync(reg)
        job = c.engine.start_job(model_name="digits", model_version="1", selector="all", rounds=3, min_devices=1,
                                 deadline_s=3600)
        c.engine.tick()
        self.job, self.cmd_id = job.id, f"{job.id}-r1"
        self.seq = 10**15  # above every number a real counter made: each case is new to the window
        self._caught: list[str] = []
        self._handler = _TracebackCatcher(self._caught)
        self._logger = logging.getLogger("edge_agent")
        self._level = self._logger.level
        self._logger.addHandler(self._handler)
        self._logger.setLevel(logging.INFO)  # what serve logs (its own lines are not shown here)

    # ---- seeds: what an honest agent sends ----
    def seed_body(self, kind: str, rng: random.Random) -> dict[str, Any]:
        from edge_agent.config import public_key_text

        job, cmd_id = self.job, self.cmd_id
        if kind == "hello":
            return {"public_key": public_key_text(self.dkey), "agent": "edge-agent/0.1",
                    "info": {"name": "barn-pi", "board": "Raspberry Pi 4 Model B", "arch": "aarch64",
                             "profile": "raspberry-pi-4", "mxnet": True, "trainers": "numpy,mxnet", "native": "neon"}}
        if kind == "state":
            return rng.choice([
                {"status": "idle", "agent": "edge-agent/0.1", "detail": "status=idle battery_pct=80 on_power=false",
                 "info": {"status": "idle", "name": "barn-pi", "battery_pct": 80.0, "charging": False,
                          "on_power": False, "energy_wh": 12.5, "power_w": 3.2, "temp_c": 51.3, "engine": "tflite",
                          "models": "digits@1", "outbox": 0, "jobs_left": 47, "jobs_limit": 48}},
                {"status": "busy", "job": job, "detail": f"status=busy battery_pct=70 job={job} power_w=4.5"},
                {"status": "offline", "agent": "edge-agent/0.1"},
                # what a stolen key sent (issue 35): numbers past a 64-bit column, in the text an
                # older agent sends instead of `info`
                {"status": "idle", "detail": "battery_pct=18446744073709551616 power_w=1e999 energy_wh=-5"}])
        if kind == "progress":
            return rng.choice([
                {"phase": "training", "job": job, "round": 1, "cmd_id": cmd_id, "pct": 42.5, "detail": "step 10",
                 "metrics": {"step": 10, "epoch": 1, "loss": 0.7, "energy_wh": 0.01, "temp_c": 50.0}},
                {"phase": "uploading", "job": job, "round": 1, "cmd_id": cmd_id, "detail": "uploading",
                 "metrics": {"accuracy_before": 0.5, "accuracy_after": 0.8, "num_samples": 40, "energy_wh": 0.02,
                             "steps": 30, "engine": "tflite", "depth": 0, "stop_reason": "done", "duration_s": 12.0,
                             "update_ratio": 3.9, "update_wire_bytes": 900, "update_k": 160, "update_bits": 8}},
                {"phase": "failed", "job": job, "round": 1, "cmd_id": cmd_id, "detail": "battery low"},
                {"phase": "model-downloading", "detail": "digits/1: fetching the full bundle"},
                {"phase": "pong", "cmd_id": "ping-1", "detail": "edge-agent/0.1 barn-pi"}])
        if kind == "refusal":
            return rng.choice([
                {"reason": "battery_low", "detail": "battery 12 % is below 40 %", "ref_kind": "cmd",
                 "ref_cmd_id": cmd_id, "ref_seq": 5, "ref_topic": self.topics.device(self.dev, "cmd")},
                {"reason": "replayed", "detail": "sequence 5 is older than the window (1024 below 99999)",
                 "ref_kind": "cmd", "ref_cmd_id": cmd_id, "ref_sha256": "ab" * 32},
                {"reason": "bad_signature", "detail": "signature does not verify", "ref_kind": "cmd"}])
        raise ValueError(kind)

    def update_seeds(self) -> list[tuple[dict[str, Any], bytes]]:
        """The chunks of a real update for round 1 (header fields, data)."""
        import hashlib

        from edge_agent.updates import UNCOMPRESSED, UpdateEncoder

        delta = {n: (a + 0.01).astype(a.dtype) - a for n, a in self.head.items()}
        encoder = UpdateEncoder(model_name="digits", device_id=self.dev, policy=UNCOMPRESSED, chunk_size=256)
        chunks = encoder.encode(delta, job_id=self.job, round=1, model_version="1").chunks()
        upload = hashlib.sha256(b"".join(chunks)).hexdigest()
        return [({"job": self.job, "round": 1, "upload": upload, "index": i, "count": len(chunks), "samples": 40,
                  "energy_wh": 0.02, "energy_kept": 1.0, "labels_sha256": "cd" * 32}, bytes(c))
                for i, c in enumerate(chunks)]

    # ---- signing whatever a case made (the Signer itself refuses a body its schema does not take) ----
    def envelope(self, kind: str, body: Any, key: Any) -> dict[str, Any]:
        from edge_agent import keys

        now = int(time.time())
        self.seq += 1
        return {"v": 1, "kind": "update_chunk" if kind == "update" else kind, "from": keys.fingerprint(key),
                "seq": self.seq, "iat": now, "exp": now + 600, "body": body}

    def seal(self, topic: str, env: Any, key: Any, data: bytes | None = None) -> bytes | None:
        """Sign `env` as its sender would (None: not JSON-encodable, so nobody could send it)."""
        import hashlib
        import struct

        from edge_agent.protocol import BINARY_MAGIC, canonical_json
        from edge_agent.protocol.envelope import _signing_input

        address = f"{self.FLEET}/{topic[len(self.topics.root) + 1:]}"
        try:
            if data is not None:
                header = canonical_json(env)
                sig = key.sign(_signing_input(address, b"B", header + hashlib.sha256(data).digest()))
                return BINARY_MAGIC + struct.pack(">H", len(header) & 0xFFFF) + header + sig + data
            raw = canonical_json(env)
            if isinstance(env, dict):
                env = {**env, "sig": base64.b64encode(key.sign(_signing_input(address, b"J", raw))).decode()}
            return canonical_json(env)
        except (TypeError, ValueError):  # lone surrogates, NaN: unsendable as JSON
            return None

    def topic(self, kind: str, key: Any) -> str:
        from edge_agent import keys

        channel = {"refusal": "progress", "update": "update"}.get(kind, kind)
        return self.topics.device(keys.fingerprint(key), channel)

    def feed(self, topic: str, payload: bytes) -> str:
        from edge_agent.protocol import Rejection

        self._caught.clear()
        self._minutes += 1
        result = self.coord.pending.open(topic, payload)
        self.coord.handle(result)
        if self._caught:
            raise AssertionError(f"a log line carries a traceback: {self._caught[0][:300]}")
        if isinstance(result, Rejection):
            return f"rejected:{result.reason}"
        return f"handled:{result.kind}" + ("" if result.sender == self.dev else ":pending")

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)
        self.coord.close()


class _TracebackCatcher(logging.Handler):
    def __init__(self, caught: list[str]) -> None:
        super().__init__(logging.INFO)
        self.caught = caught

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or record.stack_info:
            self.caught.append(record.getMessage())


class CoordinatorTarget(Target):
    """Signed device messages of one kind into the coordinator's verifier and handlers
    (coordinator/service_messages.py), as a stolen device key (or a buggy agent) could send
    them: mostly mutated bodies signed with the approved device's real key (so they reach
    the handlers), some mutated envelopes, some from the pending device, some byte-level
    damage after signing and some signed by a key nobody enrolled."""

    def __init__(self, kind: str) -> None:
        self.name = f"coordinator_{kind}"
        self.kind = kind
        self.root = scratch()
        self.host = CoordinatorHost(self.root)
        self.chunks = self.host.update_seeds() if kind == "update" else []

    def case(self, rng: random.Random) -> tuple[str, bytes | None]:
        h = self.host
        pick = rng.random()
        key = h.pkey if pick < 0.08 else h.rogue if pick < 0.12 else h.dkey
        if self.kind == "update":
            header, data = rng.choice(self.chunks)
            header = mutate_json(header, rng) if rng.random() < 0.8 else dict(header)
            if rng.random() < 0.3:
                data = mutate_bytes(data, rng, [c for _, c in self.chunks])
            if isinstance(header, dict) and isinstance(header.get("index"), int):
                header.setdefault("size", len(data))
                if rng.random() < 0.8:
                    header["size"] = len(data)
        else:
            header, data = h.seed_body(self.kind, rng), None
            header = mutate_json(header, rng) if rng.random() < 0.85 else header
        env = h.envelope(self.kind, header, key)
        if rng.random() < 0.1:
            env = mutate_json(env, rng)
        topic = h.topic(self.kind, key)
        if rng.random() < 0.03:
            topic = h.topic(rng.choice(COORDINATOR_KINDS), rng.choice((h.dkey, h.pkey)))
        payload = h.seal(topic, env, key, data)
        if payload is not None and rng.random() < 0.08:
            payload = mutate_bytes(payload, rng, [payload])
        return topic, payload

    def judge(self, data: tuple[str, bytes | None]) -> str:
        topic, payload = data
        if payload is None:
            return "unencodable"
        return self.host.feed(topic, payload)

    def close(self) -> None:
        self.host.close()
        shutil.rmtree(self.root, ignore_errors=True)
