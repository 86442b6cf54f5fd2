"""Secure aggregation's overhead (issue 39): bytes per device per round and CPU per device and
at the coordinator, for plain updates, DP only, SecAgg+ and SecAgg+ with distributed DP, at 100
and 1,000 devices (sim/secagg.py drives the real library in one process; 10 % of the devices
drop after sharing keys, so their pairwise masks are reconstructed and removed).

Plain and DP: the project's update payload (wire.encode_update, dense int8 -- the form a private
job's clipped update takes; top-k for comparison in bytes), decoded and summed at the
coordinator; DP adds the device's clip and the coordinator's noise draw. SecAgg: every message
of the four phases (JSON sizes as sent; the masked input as bytes), X25519/Ed25519 key
generation included; CPU by time.process_time around each party's own calls, one repetition
(a round of 1,000 devices is its own repetition: the figure is the median over its devices).
"""

from __future__ import annotations

import math
import time

import numpy as np

from edge_agent.coordinator.strategies.dp import GaussianSum
from edge_agent.keys import fingerprint, generate_private_key
from edge_agent.sim.secagg import secure_round
from edge_agent.updates.clip import clip_for_privacy
from edge_agent.updates.wire import UpdateHeader, decode_update, encode_update

DIGITS_HEAD = 330  # the digits demo's head: Dense 32 -> 10
BIG_HEAD = 1_000_000
DROP = 0.1
CLIP, NOISE = 1.0, 1.0


def _vectors(n: int, length: int, seed: int = 0) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {i: rng.normal(0.0, 0.5 / math.sqrt(length), length) for i in range(n)}


def plain(vectors: dict[int, np.ndarray], *, dp: bool, density: float = 1.0) -> tuple[float, float, float]:
    """(bytes per device, median device CPU s, coordinator CPU s) through the update payload."""
    n = len(vectors)
    ids = [fingerprint(generate_private_key()) for _ in range(n)]
    sizes, dev_cpu, coord = [], [], 0.0
    total = None
    gauss = GaussianSum(clip=CLIP, noise=NOISE, denominator=n, rng=lambda: np.random.default_rng(1))
    for i, v in vectors.items():
        t0 = time.process_time()
        delta = {"head": v.astype(np.float32)}
        if dp:
            delta = clip_for_privacy(delta, CLIP)[0]
        payload = encode_update(UpdateHeader("bench", "1", "job", ids[i], 1), delta, density=density, bits=8)
        dev_cpu.append(time.process_time() - t0)
        sizes.append(len(payload))
        t0 = time.process_time()
        vec = decode_update(payload).deltas["head"].astype(np.float64)
        total = vec if total is None else total + vec
        coord += time.process_time() - t0
    t0 = time.process_time()
    _ = gauss.release(total) if dp else total / n
    coord += time.process_time() - t0
    return float(np.median(sizes)), float(np.median(dev_cpu)), coord


def secure(vectors: dict[int, np.ndarray], *, dp: bool, degree: int | None = None):  # type: ignore[no-untyped-def]
    n = len(vectors)
    gauss = GaussianSum(clip=CLIP, noise=NOISE, denominator=n, rng=lambda: np.random.default_rng(1)) if dp else None
    drop = range(0, n, int(round(1 / DROP)))
    run = secure_round(vectors, clip=CLIP, dp=gauss, degree=degree, drop_before_input=drop)
    assert not run.error, run.error
    plain_sum = (sum(run.quantised[d].astype(np.uint64) for d in run.survivors) % 2**32).astype(np.uint32)
    assert np.array_equal(run.total, plain_sum)
    up = float(np.median([run.up_bytes[d] for d in run.survivors]))
    down = float(np.median([run.down_bytes[d] for d in run.survivors]))
    cpu = float(np.median([run.device_cpu[d] for d in run.survivors]))
    return up, down, cpu, run.coordinator_cpu, run.config


def run(quick: bool = False) -> str:
    start = time.perf_counter()
    rows = ["| devices | head | mode | up, bytes/device | down, bytes/device | CPU/device, ms | CPU coordinator, s |",
            "|---:|---:|---|---:|---:|---:|---:|"]
    chosen = []
    cases = [(100, DIGITS_HEAD), (1000, DIGITS_HEAD)] if not quick else [(100, DIGITS_HEAD)]
    for n, length in cases:
        vecs = _vectors(n, length)
        for label, dp in (("plain (dense int8 payload)", False), ("DP only (clip + central noise)", True)):
            b, cpu, coord = plain(vecs, dp=dp)
            rows.append(f"| {n:,} | {length:,} | {label} | {b:,.0f} | -- | {1e3 * cpu:.2f} | {coord:.2f} |")
        for label, dp in (("SecAgg+", False), ("SecAgg+ and distributed DP", True)):
            up, down, cpu, coord, cfg = secure(vecs, dp=dp)
            rows.append(f"| {n:,} | {length:,} | {label} | {up:,.0f} | {down:,.0f} | {1e3 * cpu:.2f} | {coord:.2f} |")
        chosen.append(f"{n:,} devices: degree k = {cfg.degree}, threshold t = {cfg.threshold} "
                      f"(a device's secrets survive {cfg.degree - cfg.threshold} of its {cfg.degree} neighbours dropping)")
    # the 1M head: 16 devices, complete graph (degree 15, about the 100-device round's 14)
    n, length = (16, BIG_HEAD) if not quick else (8, 100_000)
    vecs = _vectors(n, length)
    b, cpu, coord = plain(vecs, dp=False)
    rows.append(f"| {n} | {length:,} | plain (dense int8 payload) | {b:,.0f} | -- | {1e3 * cpu:.1f} | {coord:.2f} |")
    b10, _, _ = plain(dict(list(vecs.items())[:2]), dp=False, density=0.1)
    up, down, cpu, coord, cfg = secure(vecs, dp=True, degree=n - 1)
    rows.append(f"| {n} | {length:,} | SecAgg+ and distributed DP | {up:,.0f} | {down:,.0f} | {1e3 * cpu:.1f} | "
                f"{coord:.2f} |")
    chosen.append(f"{n} devices with the {length:,}-parameter head: the complete graph (k = {cfg.degree}, t = "
                  f"{cfg.threshold}); the top-k (10 %) int8 payload of the same head is {b10:,.0f} bytes")
    return "\n".join([
        "## Secure aggregation: SecAgg+ overhead (bench_secagg)",
        "",
        f"One round each; {100 * DROP:.0f} % of the devices drop after sharing keys (their pairwise masks are "
        "rebuilt from their neighbours' shares and removed). The masked input is dense fixed point in Z_2^32 "
        "(4 bytes per coordinate + 4): every device masks the same index set, so the codec's top-k does not "
        "apply. Degree: SecAgg+'s k = 2 ceil(log2 n), t = k / 2 + 1 "
        "(updates/secagg.py `default_degree`).",
        "",
        *rows,
        "",
        "Choices: " + "; ".join(chosen) + ".",
        "",
        "Up = every message the device sends (advertisement, encrypted shares, masked input, unmask answer); "
        "down = what it receives (its roster: U0 as a bitmap plus its neighbours' advertisements; its inbox of "
        "shares; its unmask request). CPU per device: median over the round's survivors (key generation, "
        "signing, Shamir, AEAD, PRG masks; for SecAgg+DP also clipping and noise); coordinator: the whole "
        "round (verifying advertisements, routing, summing, reconstructing and removing masks). Persistence "
        "of the coordinator's round state (JSON, fsync) is not in these figures. "
        f"Total wall time {time.perf_counter() - start:.0f} s.",
    ])


if __name__ == "__main__":
    print(run(quick=True))
