"""A secure-aggregation round of N simulated devices in one process, through the real library
(updates/secagg.py on every device, coordinator/secagg.py at the coordinator) and, when given
one, the coordinator's registry: the simulation behind tests/unit/test_secagg.py and
bench/bench_secagg.py.

Each device's update is clipped to the job's dp_clip and, for a private job, noised with its
share of the DP noise (`GaussianSum.device_std`, for the inputs the round may release with:
`secure_rounds.dp_min_inputs`), quantised (`Quantiser`) and masked. The
coordinator's state is saved crash-safely after every phase (and, with `restart`, reloaded
from disk before the next one, as a restarted coordinator would). Devices in `drop_before_input`
shared their keys but never send a masked input (their pairwise masks are removed from the sum
through their reconstructed keys); those in `drop_before_unmask` sent their input but do not
answer the unmask request (their input counts; they simply reveal no shares).

With a registry and a base head, the unmasked sum becomes the job's new version: the fixed-
denominator mean (dp_fedavg's `release_noised`: the noise is already in the sum) applied to
the head, registered with its round's figures.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..coordinator.secagg import SecAggRound
from ..coordinator.secure_rounds import dp_min_inputs
from ..coordinator.strategies.dp import GaussianSum
from ..keys import fingerprint, generate_private_key
from ..updates.secagg import RoundConfig, SecAggDevice, SecAggError, clip_and_noise, default_degree


@dataclass
class SecureRun:
    config: RoundConfig
    survivors: list[str]
    quantised: dict[str, np.ndarray]  # every device's quantised input (the test's ground truth)
    total: np.ndarray | None = None  # the unmasked sum (uint32), None when the round failed
    mean: np.ndarray | None = None  # the released mean (float64)
    error: str = ""
    up_bytes: dict[str, int] = field(default_factory=dict)  # per device, every message it sent
    down_bytes: dict[str, int] = field(default_factory=dict)  # per device, every message it received
    device_cpu: dict[str, float] = field(default_factory=dict)  # seconds of CPU per device (all phases)
    coordinator_cpu: float = 0.0
    version: Any = None


def _size(msg: Any) -> int:
    return len(msg) if isinstance(msg, bytes) else len(json.dumps(msg, separators=(",", ":")).encode())


def secure_round(vectors: Mapping[str, np.ndarray] | None = None, *, n: int = 0, length: int = 0, clip: float = 1.0,
                 dp: GaussianSum | None = None, degree: int | None = None, threshold: int | None = None,
                 drop_before_input: Collection[int] = (), drop_before_unmask: Collection[int] = (),
                 state_dir: str | Path | None = None, restart: bool = False, seed: int = 0,
                 registry: Any = None, base: tuple[Any, Mapping[str, np.ndarray]] | None = None,
                 tamper: Any = None, keys: list[Any] | None = None, graph_seed: str | None = None) -> SecureRun:
    """One round. `vectors`: device index -> its float update; otherwise `n` random ones of
    `length`. Drops are device indices (0..n-1). `tamper(phase, sender, msg) -> msg` may alter a
    message on its way (tests); `keys` (device Ed25519 keys, by index) and `graph_seed` fix
    the graph in advance."""
    rng = np.random.default_rng([seed, 0x5EC])
    if vectors is None:
        vectors = {i: rng.normal(0.0, 0.5 / math.sqrt(length), length) for i in range(n)}
    n = len(vectors)
    length = len(next(iter(vectors.values())))
    keys = keys if keys is not None else [generate_private_key() for _ in range(n)]
    ids = [fingerprint(k) for k in keys]
    k = degree if degree is not None else default_degree(n)
    config = RoundConfig(round_id=f"sim-{seed}/1", devices=tuple(sorted(ids)), degree=k,
                         threshold=threshold if threshold is not None else min(k, n - 1) // 2 + 1,
                         graph_seed=graph_seed or os.urandom(16).hex(), length=length, clip=clip,
                         noise_std=dp.device_std(dp_min_inputs(n, 1)) if dp is not None else 0.0)
    q = config.quantiser
    run = SecureRun(config, [], {})
    devices: dict[str, SecAggDevice] = {}
    xs: dict[str, np.ndarray] = {}
    for i, key in enumerate(keys):
        t0 = time.process_time()
        noisy = clip_and_noise(vectors[i], clip, config.noise_std, np.random.default_rng([seed, i, 0xD9]))
        xs[ids[i]] = q.quantise(noisy)
        devices[ids[i]] = SecAggDevice(device_key=key, config=config)
        run.device_cpu[ids[i]] = time.process_time() - t0
    run.quantised = xs
    run.up_bytes = dict.fromkeys(ids, 0)
    run.down_bytes = dict.fromkeys(ids, 0)
    state = Path(state_dir) / "secagg" / "round.json" if state_dir is not None else None
    coord = SecAggRound(config)
    tamper = tamper or (lambda phase, sender, msg: msg)

    def device(did: str, fn: Any, *args: Any) -> Any:
        t0 = time.process_time()
        out = fn(*args)
        run.device_cpu[did] += time.process_time() - t0
        run.up_bytes[did] += _size(out)
        return out

    def at_coordinator(fn: Any, *args: Any) -> Any:
        t0 = time.process_time()
        out = fn(*args)
        run.coordinator_cpu += time.process_time() - t0
        return out

    def checkpoint() -> SecAggRound:
        if state is None:
            return coord
        t0 = time.process_time()
        coord.save(state)
        loaded = SecAggRound.load(state) if restart else coord
        run.coordinator_cpu += time.process_time() - t0
        return loaded

    gone_input = {ids[i] for i in drop_before_input}
    gone_unmask = {ids[i] for i in drop_before_unmask}
    try:
        for did in ids:
            at_coordinator(coord.receive_advert, did, tamper("advert", did, device(did, devices[did].advertise)))
        roster = at_coordinator(coord.close_advertise)
        coord = checkpoint()
        for did in ids:
            run.down_bytes[did] += _size(roster[did])
            msg = device(did, devices[did].share_keys, roster[did])
            at_coordinator(coord.receive_shares, did, tamper("shares", did, msg))
        inbox = at_coordinator(coord.close_share)
        coord = checkpoint()
        for did in ids:
            run.down_bytes[did] += _size(inbox[did])
            if did in gone_input:
                continue
            masked = device(did, devices[did].masked_input, tamper("inbox", did, inbox[did]), xs[did])
            at_coordinator(coord.receive_masked, did, masked)
        request = at_coordinator(coord.close_mask)
        coord = checkpoint()
        run.survivors = sorted(request)
        for did in run.survivors:
            run.down_bytes[did] += _size(request[did])
            if did in gone_unmask:
                continue
            answer = device(did, devices[did].unmask, request[did])
            at_coordinator(coord.receive_unmask, did, tamper("unmask", did, answer))
        coord = checkpoint()
        run.total = at_coordinator(coord.close_unmask)
        checkpoint()
    except SecAggError as e:  # the round's refusal is the result
        if state is not None:
            coord.save(state)
        run.error = str(e)
        return run
    t0 = time.process_time()
    plain = q.decode_sum(run.total)
    run.mean = dp.release_noised(plain) if dp is not None else plain / len(run.survivors)
    run.coordinator_cpu += time.process_time() - t0
    if registry is not None and base is not None:
        mv, head = base
        flat, out, at = run.mean, {}, 0
        for name, arr in head.items():
            out[name] = (np.asarray(arr, np.float64) + flat[at:at + arr.size].reshape(arr.shape)).astype(np.float32)
            at += arr.size
        run.version = registry.add_model_version(
            name=mv.name, version=str(int(mv.version) + 1), head=out, parent=mv.version,
            metrics={"secagg_survivors": len(run.survivors), "secagg_dropped": len(coord.dropped),
                     "secagg_threshold": config.threshold, "secagg_degree": config.degree})
    return run
