"""The device side: error feedback + policy + codec + wire format, around one residual.

    enc = UpdateEncoder(model_name="digits-head", device_id="dev-07",
                        policy=CompressionPolicy(budget_bytes=4096, warmup_rounds=3),
                        store=ResidualStore(state_dir / "residual.bin"),
                        table=tensor_table(model_params))      # the model's dtypes
    update = enc.encode(delta, job_id=job, round=r, model_version=base_version)
    outbox.put(update.chunks(signature=sign(update.digest)))   # durable first ...
    enc.commit(update)                                         # ... then adopt the residual

Error feedback (Seide et al. 2014; Karimireddy et al. 2019): each round encodes
`delta + residual` and keeps `residual = (delta + residual) - sent`, so nothing is lost,
only delayed: sum(sent) + residual == sum(delta) over any number of rounds.
Size: never more than the plain fp32 delta (4 bytes a value) when anything smaller fits:
with a budget (explicit or the adaptive default, policy.py) the budget is capped at that,
so the most accurate update within it is chosen (for a small head: dense int8, ~x2-x4
smaller, ~99.99 % of the energy); a fixed-rate update bigger than the exact fp32 update is
replaced by the exact one. `EncodedUpdate.energy_kept` is the fraction of the encoded
delta's energy (squared L2 norm) the update carries: 1 - |x - sent|^2 / |x|^2.

Encoding is deterministic, so if the device reboots between queueing and commit, encoding
the same round again from the same residual gives a byte-identical payload (same sha256),
which the coordinator de-duplicates by (job, device, round).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .budget import choose_for_budget
from .chunks import DEFAULT_CHUNK_SIZE, split_chunks, wire_size
from .codec import (
    EncodedTensor,
    Tensors,
    TensorSpec,
    check_finite,
    check_table,
    decode_tensors,
    encode_tensors,
    model_table,
    select_positions,
    tensor_table,
)
from .policy import CompressionPolicy
from .residual import ResidualStore
from .wire import UpdateHeader, pack_update, payload_digest


@dataclass(frozen=True)
class EncodedUpdate:
    header: UpdateHeader
    payload: bytes
    digest: bytes  # sha256(payload): sign this
    sent: dict[str, np.ndarray]  # exactly what the coordinator will decode
    residual: dict[str, np.ndarray] | None  # error-feedback state after this update
    k: int  # values sent, all tensors together
    bits: int
    dense_bytes: int  # bytes of the fp32 delta
    wire_bytes: int  # bytes of all chunks (with the policy's signature room)
    chunk_size: int
    energy_kept: float = 1.0  # 1 - |x - sent|^2 / |x|^2 of the encoded x = delta + residual

    @property
    def ratio(self) -> float:
        """Compression ratio: fp32 delta bytes / bytes on the wire."""
        return self.dense_bytes / self.wire_bytes

    def chunks(self, signature: bytes = b"") -> list[bytes]:
        """The MQTT messages, `signature` (of `digest`) in the first."""
        return split_chunks(self.payload, chunk_size=self.chunk_size, signature=signature)


class UpdateEncoder:
    """Encodes a device's successive deltas, holding (and persisting) the residual."""

    def __init__(
        self,
        *,
        model_name: str,
        device_id: str,
        policy: CompressionPolicy | None = None,
        store: ResidualStore | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        table: Sequence[TensorSpec] | None = None,
    ) -> None:
        """`table`: the model's tensor table (names, shapes, dtypes) to declare on the wire;
        deltas must match its names and shapes. Default: each delta's own (float32)."""
        self.model_name = model_name
        self.table = None if table is None else tuple(table)
        self.device_id = device_id
        self.policy = policy or CompressionPolicy()
        self.store = store
        self.chunk_size = chunk_size
        wire_size(1, chunk_size, self.policy.signature_bytes)  # validates chunk_size early
        self._residual: dict[str, np.ndarray] | None = None
        self.last_round: int | None = None
        if store is not None:
            stored = store.load()  # a corrupt file raises: the caller decides to clear() it
            if stored is not None and stored.model_name == model_name:
                self._residual, self.last_round = stored.residual, stored.round

    @property
    def residual(self) -> dict[str, np.ndarray] | None:
        """The committed residual (copies), None before the first commit."""
        return None if self._residual is None else {n: a.copy() for n, a in self._residual.items()}

    def encode(
        self, delta: Tensors, *, job_id: str, round: int, model_version: str
    ) -> EncodedUpdate:
        """Encode `delta` (+ residual) for `round`. Does not change state: call `commit`."""
        check_finite(delta)
        table = model_table(delta, self.table)
        corrected = {s.name: np.array(delta[s.name], dtype=np.float32) for s in table}
        if self.policy.error_feedback and self._residual is not None:
            check_table(
                tensor_table(self._residual),
                [TensorSpec(s.name, s.shape, "float32") for s in table],
                what="stored residual",
            )
            with np.errstate(over="ignore", invalid="ignore"):  # overflow is refused just below
                for name, arr in corrected.items():
                    arr += self._residual[name]
            check_finite(corrected, what="delta + residual")
        settings = self.policy.settings(round)
        header = UpdateHeader(
            self.model_name, model_version, job_id, self.device_id, round, settings.scope
        )
        numel = sum(s.numel for s in table)
        if settings.budget_bytes is not None:
            budget = self._budget_for(corrected, header, table, settings.budget_bytes, settings.dense_factor)
            choice = choose_for_budget(
                corrected,
                header,
                budget,
                bits_choices=settings.bits_choices,
                chunk_size=self.chunk_size,
                signature_bytes=self.policy.signature_bytes,
                table=table,
            )
            encoded, bits = choice.encoded, choice.bits
        else:
            positions = select_positions(corrected, settings.density, settings.scope)
            encoded = encode_tensors(corrected, positions, settings.bits, table=table)
            bits = settings.bits
            exact = self._dense(corrected, table, 32)
            if len(pack_update(header, encoded)) > len(pack_update(header, exact)):
                encoded = exact  # never bigger than the plain fp32 delta: send that instead
                bits = 32
        payload = pack_update(header, encoded)
        sent = decode_tensors(encoded)
        residual = (
            {n: corrected[n] - sent[n] for n in corrected} if self.policy.error_feedback else None
        )
        total = sum(float(np.sum(np.square(a, dtype=np.float64))) for a in corrected.values())
        lost = sum(float(np.sum(np.square(corrected[n] - sent[n], dtype=np.float64))) for n in corrected)
        energy_kept = 1.0 if total == 0.0 else min(1.0, max(0.0, 1.0 - lost / total))
        return EncodedUpdate(
            header=header,
            payload=payload,
            digest=payload_digest(payload),
            sent=sent,
            residual=residual,
            k=sum(e.k for e in encoded),
            bits=bits,
            dense_bytes=4 * numel,
            wire_bytes=wire_size(len(payload), self.chunk_size, self.policy.signature_bytes),
            chunk_size=self.chunk_size,
            energy_kept=energy_kept,
        )

    @staticmethod
    def _dense(delta: Tensors, table: Sequence[TensorSpec], bits: int) -> list[EncodedTensor]:
        """Every value of every tensor at `bits` (no index bytes: the 'all' coding)."""
        everything = {s.name: np.arange(s.numel, dtype=np.int64) for s in table}
        return encode_tensors(delta, everything, bits, table=table)

    def _wire(self, payload_len: int) -> int:
        return wire_size(payload_len, self.chunk_size, self.policy.signature_bytes)

    def _budget_for(self, delta: Tensors, header: UpdateHeader, table: Sequence[TensorSpec],
                    budget: int, dense_factor: float) -> int:
        """The budget to search: the adaptive default's grows to a dense int8 update that is
        within `dense_factor` of it; every budget is capped at the plain fp32 delta's bytes
        (or the dense int8 update, for a delta so small that the header outweighs it)."""
        numel = sum(s.numel for s in table)
        cap = 4 * numel
        if numel <= max(dense_factor * budget, 1024):  # int8 takes >= 1 byte a value: else moot
            dense8 = self._wire(len(pack_update(header, self._dense(delta, table, 8))))
            cap = max(cap, dense8)
            if dense_factor and dense8 <= dense_factor * budget:
                budget = max(budget, dense8)
        return min(budget, cap)

    def commit(self, update: EncodedUpdate) -> None:
        """Adopt `update`'s residual (after its chunks are durably queued) and persist it."""
        if update.residual is None:
            return
        if self.store is not None:
            self.store.save(update.residual, model_name=self.model_name, round=update.header.round)
        self._residual = {n: a.copy() for n, a in update.residual.items()}
        self.last_round = update.header.round

    def reset(self) -> None:
        """Drop the residual (and its file), e.g. after the model's tensor table changed."""
        self._residual, self.last_round = None, None
        if self.store is not None:
            self.store.clear()
