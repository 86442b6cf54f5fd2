"""Generated-message fuzzing of every parser that sees untrusted bytes on a device, and of the
coordinator's handlers of what devices send.

Each target is fed mutations of real, valid inputs (made here with real keys, the real
codec and the demo's real bundle), so most cases get past the first check and reach the
deeper ones:

    envelope    Verifier.open(topic, bytes) on command, update-chunk and model topics
    command     a coordinator-signed `cmd` whose JSON body is mutated, then (when the
                verifier accepts it) the agent's policy: parse_finetune + check_finetune
    chunk       parse_chunk + one long-lived Reassembler (its memory bounds are checked)
    manifest    a bundle's manifest.json bytes (bundle.parse_manifest)
    bundle_tar  a bundle archive (gzip or plain tar) through unpack_bundle into a temp dir
    coordinator_<kind>  (hello, state, progress, refusal, update) a device message signed
                by the approved device's key (mostly), its body mutated, through the serving
                coordinator's verifier and handler (CoordinatorHost)

A crash is any exception other than the target's documented refusal (Rejection objects,
InputError subclasses, policy.BadParams); each is recorded with its case number and input,
so `python -m bench.fuzz_parsers --target T --replay N --seed S` reproduces it.
The mutation stream is a pure function of (seed, case number).
"""

from __future__ import annotations

import argparse
import base64
import copy
import json
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

INTERESTING = (0, 1, 0x7F, 0x80, 0xFF, 0x20, 0x22, 0x5C, 0x7B, 0x7D)
JSON_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63), 10**400, 1e308, -1e308, 0.5, "", "x" * 300,
    "../../etc/passwd", "\u0000", "\ud800", [], {}, [[[[[[]]]]]], {"a": {"b": {"c": 1}}}, "NaN", "current",
)


def mutate_bytes(data: bytes, rng: random.Random, corpus: list[bytes]) -> bytes:
    """One to four byte-level mutations (AFL's havoc stages, simplified)."""
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(9)
        n = len(out)
        if op == 0 and n:  # flip 1..8 bits
            for _ in range(rng.randint(1, 8)):
                i = rng.randrange(n)
                out[i] ^= 1 << rng.randrange(8)
        elif op == 1 and n:  # interesting byte
            out[rng.randrange(n)] = rng.choice(INTERESTING)
        elif op == 2:  # insert random bytes
            i = rng.randint(0, n)
            out[i:i] = rng.randbytes(rng.randint(1, 64))
        elif op == 3 and n:  # delete a range
            i = rng.randrange(n)
            del out[i:i + rng.randint(1, 256)]
        elif op == 4 and n:  # truncate
            del out[rng.randrange(n):]
        elif op == 5 and n:  # duplicate a range
            i = rng.randrange(n)
            out[i:i] = out[i:i + rng.randint(1, 512)]
        elif op == 6 and corpus:  # splice with another seed
            other = rng.choice(corpus)
            i, j = rng.randint(0, n), rng.randint(0, len(other))
            out = out[:i] + other[j:]
        elif op == 7 and n >= 4:  # a 16/32-bit field set to a boundary
            i = rng.randrange(n - 3)
            value = rng.choice((0, 1, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, n, n + 1))
            out[i:i + 4] = value.to_bytes(4, rng.choice(("little", "big")))
        elif op == 8:  # random bytes of a plausible length
            out = bytearray(rng.randbytes(rng.choice((0, 1, 5, 64, 1024, n))))
    return bytes(out)


def _value(rng: random.Random) -> Any:
    return copy.deepcopy(rng.choice(JSON_VALUES))  # a fresh copy: later mutations must not alias


def mutate_json(obj: Any, rng: random.Random) -> Any:
    """Structure-aware: change, drop or add one member somewhere in the document."""
    obj = copy.deepcopy(obj)
    for _ in range(rng.randint(1, 3)):
        holder, key = _random_slot(obj, rng)
        if holder is None:
            return _value(rng)
        choice = rng.randrange(4)
        if choice == 0:
            holder[key] = _value(rng)
        elif choice == 1 and isinstance(holder, dict):
            holder.pop(key, None)
        elif choice == 2 and isinstance(holder, dict):
            holder[rng.choice(("extra", "params", "seq", "body", "files", "x" * 70))] = _value(rng)
        else:
            value = holder[key]
            if isinstance(value, str) and value:
                holder[key] = value[: rng.randrange(len(value))] + rng.choice(("/", "\n", "Ω", "%", "."))
            elif isinstance(value, int | float) and not isinstance(value, bool):
                holder[key] = rng.choice((-value, value * 10**9, value + 1, value / 3 if abs(value) < 1e300 else 0.5))
            else:
                holder[key] = _value(rng)
    return obj


def _random_slot(obj: Any, rng: random.Random) -> tuple[Any, Any]:
    slots: list[tuple[Any, Any]] = []

    def walk(node: Any, depth: int) -> None:
        if depth > 6:
            return
        items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in items:
            slots.append((node, k))
            walk(v, depth + 1)

    walk(obj, 0)
    return rng.choice(slots) if slots else (None, None)


@dataclass
class FuzzResult:
    target: str
    cases: int = 0
    seconds: float = 0.0
    verdicts: Counter = field(default_factory=Counter)
    crashes: list[tuple[int, str, str]] = field(default_factory=list)  # case, error, input (hex, cut)

    @property
    def rate(self) -> float:
        return self.cases / self.seconds if self.seconds else 0.0


class Target:
    """One parser under fuzz: `case(rng)` makes an input, `judge(input)` returns a verdict
    label or raises for a crash (anything outside `refusals`)."""

    name = ""
    refusals: tuple[type[BaseException], ...] = ()

    def case(self, rng: random.Random) -> Any:
        raise NotImplementedError

    def judge(self, data: Any) -> str:
        raise NotImplementedError

    def refusal_verdict(self, exc: BaseException) -> str:
        return type(exc).__name__

    def close(self) -> None:
        pass


def _scratch() -> Path:
    base = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else None  # fsync-heavy targets
    return Path(tempfile.mkdtemp(prefix="edge-fuzz-", dir=base))


class _Fleet:
    """Keys, topics, a signer per side and a verifier as the agent runs it."""

    def __init__(self, root: Path) -> None:
        from edge_agent import keys
        from edge_agent.protocol import (
            ReplayWindow,
            SequenceCounter,
            Signer,
            Topics,
            TrustStore,
            Verifier,
        )

        self.topics = Topics(fleet="fuzz", prefix="fuzz/edgeft/v1")
        self.ckey, self.dkey = keys.generate_private_key(), keys.generate_private_key()
        self.dev = keys.fingerprint(self.dkey)
        self.coord = Signer(key=self.ckey, topics=self.topics, sequence=SequenceCounter(path=root / "c.seq"))
        self.device = Signer(key=self.dkey, topics=self.topics, sequence=SequenceCounter(path=root / "d.seq"))
        self.trust = TrustStore()
        self.trust.add(self.ckey.public_key(), role="coordinator")
        self.trust.add(self.dkey.public_key(), role="device")
        self.verifier = Verifier(topics=self.topics, trust=self.trust, replay=ReplayWindow(directory=root / "replay"))
        self.cmd_topic = self.topics.device(self.dev, "cmd")
        self.cmd_address = self.topics.parse(self.cmd_topic).address  # type: ignore[union-attr]


def _finetune_body(job: str = "j1", rnd: int = 1) -> dict[str, Any]:
    return {"cmd_id": f"{job}-r{rnd}", "action": "finetune", "job": job, "round": rnd, "model": "digits",
            "version": "1", "sha256": "ab" * 32,
            "params": {"epochs": 3, "lr": 0.05, "budget_wh": 0.5, "deadline": time.time() + 3600,
                       "update_bytes": 4096}}


class EnvelopeTarget(Target):
    name = "envelope"

    def __init__(self) -> None:
        from edge_agent.protocol import Kind

        self.root = _scratch()
        f = self.fleet = _Fleet(self.root)
        chunk_topic = f.topics.device(f.dev, "update")
        model_topic = f.topics.model_chunk("digits", "1", 0)
        self.seeds = [
            (f.cmd_topic, f.coord.control(f.cmd_topic, Kind.CMD, {"cmd_id": "p1", "action": "ping"}, ttl=600)),
            (f.cmd_topic, f.coord.control(f.cmd_topic, Kind.CMD, _finetune_body(), ttl=600)),
            (f.topics.manifest("digits", "1"), f.coord.control(
                f.topics.manifest("digits", "1"), Kind.MANIFEST,
                {"name": "digits", "version": "1", "sha256": "cd" * 32, "size": 512, "chunks": 1,
                 "chunk_size": 512}, ttl=3600)),
            (model_topic, f.coord.binary(model_topic, Kind.MODEL_CHUNK, {"name": "digits", "version": "1",
                                         "sha256": "cd" * 32, "index": 0, "count": 1}, os.urandom(512), ttl=3600)),
            (chunk_topic, f.device.binary(chunk_topic, Kind.UPDATE_CHUNK, {"job": "j1", "round": 1,
                                          "upload": "ef" * 32, "index": 0, "count": 1, "samples": 40},
                                          os.urandom(256), ttl=3600)),
        ]
        self.corpus = [s for _, s in self.seeds]
        self.topics = [t for t, _ in self.seeds] + ["fuzz/edgeft/v1/other/x", f.topics.device("0" * 16, "cmd")]

    def case(self, rng: random.Random) -> tuple[str, bytes]:
        topic, seed = rng.choice(self.seeds)
        if rng.random() < 0.1:
            topic = rng.choice(self.topics)
        return topic, mutate_bytes(seed, rng, self.corpus)

    def judge(self, data: tuple[str, bytes]) -> str:
        from edge_agent.protocol import Rejection

        out = self.fleet.verifier.open(*data)  # documented: untrusted bytes never raise
        return f"rejected:{out.reason}" if isinstance(out, Rejection) else f"accepted:{out.kind}"

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class CommandTarget(Target):
    """Bodies a hostile (or buggy) coordinator could sign: everything past the signature."""

    name = "command"

    def __init__(self) -> None:
        from edge_agent.agent.policy import DeviceLimits
        from edge_agent.protocol.finetune import BadParams

        self.root = _scratch()
        self.fleet = _Fleet(self.root)
        (self.root / "data").mkdir()
        self.limits = DeviceLimits(data_dir=str(self.root / "data"), energy_wh=2.0, power_cap_w=5.0)
        self.refusals = (BadParams,)
        self.seq = 10**15  # above anything the counter made: each case is fresh for the window
        self.seeds = [_finetune_body(), {"cmd_id": "c1", "action": "cancel", "job": "j1"},
                      {"cmd_id": "p1", "action": "ping"}, {"cmd_id": "f1", "action": "fetch_model",
                                                            "model": "digits", "version": "1"}]

    def case(self, rng: random.Random) -> dict[str, Any]:
        now = int(time.time())
        self.seq += 1
        env = {"v": 1, "kind": "cmd", "from": self.fleet.coord.key_id, "seq": self.seq, "iat": now,
               "exp": now + 600, "body": rng.choice(self.seeds)}
        return mutate_json(env, rng) if rng.random() < 0.2 else {**env, "body": mutate_json(env["body"], rng)}

    def judge(self, env: Any) -> str:
        from edge_agent.agent.policy import Conditions, check_finetune
        from edge_agent.protocol import Kind, Rejection
        from edge_agent.protocol.envelope import _signing_input, canonical_json
        from edge_agent.protocol.finetune import parse_finetune

        f = self.fleet
        if isinstance(env, dict):
            env = {k: v for k, v in env.items() if k != "sig"}
        try:
            raw = canonical_json(env)
        except (TypeError, ValueError):  # not JSON-encodable (e.g. lone surrogates): unsendable
            return "unencodable"
        if isinstance(env, dict):
            env["sig"] = base64.b64encode(f.ckey.sign(_signing_input(f.cmd_address, b"J", raw))).decode()
            raw = canonical_json(env)
        out = f.verifier.open(f.cmd_topic, raw)
        if isinstance(out, Rejection):
            return f"rejected:{out.reason}"
        if out.kind is not Kind.CMD or out.body.get("action") != "finetune":
            return f"accepted:{out.body.get('action')}"
        req = parse_finetune(out.body, deadline_s=self.limits.deadline_s)
        verdict = check_finetune(req, self.limits, Conditions(battery_pct=80.0), active=[], accepted_last_day=0)
        return "accepted:finetune" if verdict.accept else f"refused:{verdict.reason}"

    def refusal_verdict(self, exc: BaseException) -> str:
        return "bad_params"

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


class ChunkTarget(Target):
    name = "chunk"

    def __init__(self) -> None:
        from edge_agent.errors import InputError
        from edge_agent.updates.chunks import Reassembler, split_chunks

        self.refusals = (InputError,)
        payload = os.urandom(9000)
        self.corpus = [bytes(c) for c in split_chunks(payload, chunk_size=4096, signature=os.urandom(64))]
        self.corpus += [bytes(c) for c in split_chunks(os.urandom(300), chunk_size=4096)]
        self.reassembler = Reassembler(max_pending=16, max_pending_bytes=1 << 20, remember=256)

    def case(self, rng: random.Random) -> bytes:
        seed = rng.choice(self.corpus)
        return seed if rng.random() < 0.02 else mutate_bytes(seed, rng, self.corpus)

    def judge(self, raw: bytes) -> str:
        from edge_agent.updates.chunks import parse_chunk

        parse_chunk(raw)
        done = self.reassembler.add(raw)
        r = self.reassembler
        if r.pending > r.max_pending or r._buffered() > r.max_pending_bytes:  # noqa: SLF001 - the bound under test
            raise AssertionError(f"reassembler over its bounds: {r.pending} pending, {r._buffered()} bytes")  # noqa: SLF001
        return "complete" if done else "buffered"


def demo_bundle_dir() -> Path:
    """The demo's digits bundle, built once into build/ (MXNet, a few seconds)."""
    from edge_agent.sim import scenario as demo

    return demo.ensure_bundle(Path(__file__).resolve().parent.parent / "build" / "fuzz" / "digits-bundle")


class ManifestTarget(Target):
    name = "manifest"

    def __init__(self, bundle_dir: Path | None = None) -> None:
        from edge_agent.errors import InputError
        from edge_agent.int8.bundle import MANIFEST

        self.refusals = (InputError,)
        self.seed = json.loads((bundle_dir or demo_bundle_dir()).joinpath(MANIFEST).read_bytes())
        self.raw = json.dumps(self.seed, indent=1).encode()

    def case(self, rng: random.Random) -> bytes:
        if rng.random() < 0.5:
            return json.dumps(mutate_json(self.seed, rng)).encode()
        return mutate_bytes(self.raw, rng, [self.raw])

    def judge(self, raw: bytes) -> str:
        from edge_agent.int8.bundle import parse_manifest

        manifest = parse_manifest(raw, where="manifest.json")
        return f"accepted:{len(manifest.files)} files"


class BundleTarTarget(Target):
    name = "bundle_tar"

    def __init__(self, bundle_dir: Path | None = None) -> None:
        import gzip
        import io
        import tarfile

        from edge_agent.errors import InputError
        from edge_agent.int8.bundle import pack_bundle

        self.refusals = (InputError,)
        self.root = _scratch()
        src = bundle_dir or demo_bundle_dir()
        gz = pack_bundle(src, self.root / "seed.tar.gz").read_bytes()
        plain = gzip.decompress(gz)
        with tarfile.open(fileobj=io.BytesIO(plain)) as tar:  # a second seed: members reordered
            members = [(m, tar.extractfile(m).read()) for m in tar.getmembers()]  # type: ignore[union-attr]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for m, data in reversed(members):
                tar.addfile(m, io.BytesIO(data))
        self.corpus = [gz, plain, buf.getvalue()]
        self.path = self.root / "case.tar"
        self.n = 0

    def case(self, rng: random.Random) -> bytes:
        seed = rng.choice(self.corpus)
        return seed if rng.random() < 0.01 else mutate_bytes(seed, rng, self.corpus)

    def judge(self, data: bytes) -> str:
        from edge_agent.int8.bundle import unpack_bundle

        self.path.write_bytes(data)
        self.n += 1
        dest = self.root / f"out{self.n}"
        try:
            unpack_bundle(self.path, dest)
            return "accepted"
        finally:
            shutil.rmtree(dest, ignore_errors=True)
            leftovers = [p for p in self.root.iterdir() if p.name not in ("seed.tar.gz", "case.tar")]
            if leftovers:  # a refused archive must leave nothing behind
                for p in leftovers:
                    shutil.rmtree(p, ignore_errors=True)
                raise AssertionError(f"unpack left {sorted(p.name for p in leftovers)} behind")

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


# ---------------------------------------------------------------- the coordinator's handlers
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
        c._sync_trust()  # noqa: SLF001 - what serve's tick does after an approval
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
        self.root = _scratch()
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


TARGETS: dict[str, Callable[[], Target]] = {
    "envelope": EnvelopeTarget, "command": CommandTarget, "chunk": ChunkTarget,
    "manifest": ManifestTarget, "bundle_tar": BundleTarTarget,
    **{f"coordinator_{k}": (lambda k=k: CoordinatorTarget(k)) for k in COORDINATOR_KINDS},
}


def case_rng(seed: int, index: int) -> random.Random:
    return random.Random(seed * 1_000_003 + index)


def fuzz(target: Target, cases: int, *, seed: int = 0, first: int = 0,
         progress: Callable[[FuzzResult], None] | None = None) -> FuzzResult:
    """Run `cases` generated inputs through `target`; crashes are recorded, never raised."""
    result = FuzzResult(target.name)
    start = time.perf_counter()
    for i in range(first, first + cases):
        data = target.case(case_rng(seed, i))
        try:
            verdict = target.judge(data)
        except target.refusals as exc:
            verdict = target.refusal_verdict(exc)
        except Exception as exc:  # the finding: anything undocumented
            verdict = "CRASH"
            shown = data if isinstance(data, bytes) else json.dumps(data, default=str).encode()
            result.crashes.append((i, f"{type(exc).__name__}: {str(exc)[:200]}", shown[:300].hex()))
        # verdict labels carry details after ':'; past 40 distinct labels count by kind only
        result.verdicts[verdict.split(":")[0] if len(result.verdicts) > 40 else verdict] += 1
        result.cases += 1
        if progress and result.cases % 10_000 == 0:
            result.seconds = time.perf_counter() - start
            progress(result)
    result.seconds = time.perf_counter() - start
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", choices=sorted(TARGETS), action="append", help="default: all")
    p.add_argument("--cases", type=int, default=100_000, help="generated inputs per target (default 100000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--replay", type=int, help="run only case N (reproduce a crash) and show the traceback")
    args = p.parse_args(argv)
    crashed = 0
    for name in args.target or sorted(TARGETS):
        target = TARGETS[name]()
        try:
            if args.replay is not None:
                data = target.case(case_rng(args.seed, args.replay))
                print(f"{name} case {args.replay}: {target.judge(data)}")
                continue
            res = fuzz(target, args.cases, seed=args.seed, progress=lambda r: print(
                f"  {r.target}: {r.cases} cases, {r.rate:.0f}/s, {len(r.crashes)} crashes", file=sys.stderr))
        finally:
            target.close()
        crashed += len(res.crashes)
        print(f"{name}: {res.cases} cases in {res.seconds:.0f} s, {len(res.crashes)} crashes; "
              f"verdicts {dict(res.verdicts.most_common(8))}")
        for case, err, _ in res.crashes[:10]:
            print(f"  case {case}: {err}")
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
