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
The mutations and `fuzz` itself are bench/fuzz_core.py's; the coordinator targets are
bench/fuzz_coordinator.py's.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.fuzz_coordinator import COORDINATOR_KINDS, CoordinatorTarget
from bench.fuzz_core import Target, case_rng, fuzz, mutate_bytes, mutate_json, scratch


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

        self.root = scratch()
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

        self.root = scratch()
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
        self.root = scratch()
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


TARGETS: dict[str, Callable[[], Target]] = {
    "envelope": EnvelopeTarget, "command": CommandTarget, "chunk": ChunkTarget,
    "manifest": ManifestTarget, "bundle_tar": BundleTarTarget,
    **{f"coordinator_{k}": (lambda k=k: CoordinatorTarget(k)) for k in COORDINATOR_KINDS},
}


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
