"""The local inference service: HTTP for the device's own applications.

    POST /v1/predict?k=3     image bytes, .npy/.npz, or JSON {"array": ...}
                             -> {"predictions": [{"id", "label", "score", "top"}], "model", "latency_ms"}
    POST /v1/samples?label=L image / array bytes + its label -> stored into the data set (201)
    POST /v1/samples         JSON {"prediction_id": ID, "label": L}: a correction of an earlier prediction
    GET  /v1/model           the served version, its held-out accuracy on the device's own samples,
                             the fleet and personal candidates, the samples held, inference energy
    POST /v1/finetune        start a local fine-tune now (202; 409 while one runs)
    GET  /v1/health          200 once a model is served (503 before)

Every request is answered whole by one model (serving.ModelSlot), and the answer names it.
Requests are decoded and run in ONE worker thread, in arrival order: inference is CPU-bound
and a Pi has few cores, so queueing beats contention; more than `max_inflight` requests
being served or queued get 429 at once (Retry-After: 1). A body larger than `max_body_mb`
gets 413 (from Content-Length before reading, else while reading), one slower than
`read_timeout_s` 408; anything that is not a usable input gets 4xx naming what was wrong
(inputs.py). Nothing a request sends can stop the service: an unexpected error is a 500
with its type, and the next request is served.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError
from .inputs import InputRejected, decode
from .predictor import top_k
from .samples import SampleStore, UnknownLabel

log = logging.getLogger(__name__)
MAX_JSON_CORRECTION = 4096


class HttpError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass(frozen=True)
class ServiceLimits:
    top_k: int = 3
    max_body_bytes: int = 8 << 20
    max_image_pixels: int = 4_000_000
    max_batch: int = 256
    max_inflight: int = 16
    read_timeout_s: float = 10.0
    prediction_memory_bytes: int = 16 << 20


class RecentPredictions:
    """Prediction id -> the raw sample, for corrections; bounded in bytes, oldest out first."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = int(max_bytes)
        self._items: collections.OrderedDict[str, tuple[np.ndarray, str]] = collections.OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, raw: np.ndarray, version: str) -> str:
        ident = uuid.uuid4().hex
        if self.max_bytes <= 0:
            return ident
        integral = raw.min() >= 0 and raw.max() <= 255 and np.array_equal(raw, np.rint(raw))
        kept = raw.astype(np.uint8) if integral else raw.astype(np.float32)
        with self._lock:
            self._items[ident] = (kept, version)
            self._bytes += kept.nbytes
            while self._bytes > self.max_bytes and self._items:
                _, (old, _) = self._items.popitem(last=False)
                self._bytes -= old.nbytes
        return ident

    def get(self, ident: str) -> tuple[np.ndarray, str] | None:
        with self._lock:
            found = self._items.get(ident)
        return None if found is None else (found[0].astype(np.float32), found[1])


class InferenceService:
    """The routes' logic over a ModelManager, a sample store and a local fine-tune."""

    def __init__(self, *, manager: Any, limits: ServiceLimits, samples_factory: Callable[[Any], SampleStore] | None,
                 energy: Any, finetune: Any | None = None, finetune_after: int = 0,
                 on_change: Callable[[], None] = lambda: None) -> None:
        self.manager, self.limits, self.energy = manager, limits, energy
        self.samples_factory, self.samples = samples_factory, None
        self.finetune, self.finetune_after = finetune, int(finetune_after)
        self.on_change = on_change
        self.recent = RecentPredictions(limits.prediction_memory_bytes)
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="edge-infer")
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        self.stats = collections.Counter()
        self.new_samples = 0  # since the last local fine-tune started

    # ---- helpers ----
    def sample_store(self, model: Any) -> SampleStore:
        if self.samples_factory is None:
            raise HttpError(503, "sample capture is off: set [data] dir in agent.toml")
        labels = model.predictor.labels
        if self.samples is None or self.samples.labels != labels or self.samples.spec != model.predictor.spec:
            self.samples = self.samples_factory(model.predictor)
        return self.samples

    def admit(self) -> None:
        with self._inflight_lock:
            if self._inflight >= self.limits.max_inflight:
                self.stats["overloaded"] += 1
                raise HttpError(429, f"overloaded: {self._inflight} requests in progress (max_inflight "
                                f"{self.limits.max_inflight}); retry shortly", {"Retry-After": "1"})
            self._inflight += 1

    def release(self) -> None:
        with self._inflight_lock:
            self._inflight -= 1

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    def _timed(self, fn: Callable[[], Any]) -> Any:
        cpu = time.thread_time()
        try:
            return fn()
        finally:
            self.energy.add(time.thread_time() - cpu)

    # ---- the work, in the worker thread ----
    def predict(self, body: bytes, content_type: str, k: int) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            t0 = time.perf_counter()
            with self.manager.slot.use() as model:
                raw = decode(body, model.predictor.spec, content_type=content_type,
                             max_pixels=self.limits.max_image_pixels, max_samples=self.limits.max_batch)
                logits = model.predictor.logits(raw)
                ranked = top_k(logits, model.predictor.labels, k)
                preds = [{"id": self.recent.put(raw[i], model.version), **r.to_json()} for i, r in enumerate(ranked)]
                return {"predictions": preds, "model": {"version": model.version, "kind": model.kind},
                        "latency_ms": round((time.perf_counter() - t0) * 1000.0, 3)}

        return self._timed(work)

    def add_sample(self, body: bytes, content_type: str, query_label: str | None) -> dict[str, Any]:
        def work() -> dict[str, Any]:
            with self.manager.slot.use() as model:
                store = self.sample_store(model)
                ctype = content_type.split(";", 1)[0].strip().lower()
                correction = None
                if ctype == "application/json" and len(body) <= MAX_JSON_CORRECTION:
                    try:
                        obj = json.loads(body)
                    except ValueError as exc:
                        raise InputRejected(f"request body: not JSON ({str(exc)[:100]})", 400) from None
                    if isinstance(obj, dict) and "prediction_id" in obj:
                        correction = obj
                if correction is not None:
                    label_ = correction.get("label")
                    ident = correction.get("prediction_id")
                    if not isinstance(label_, str) or not isinstance(ident, str):
                        raise InputRejected("a correction is {\"prediction_id\": \"...\", \"label\": \"...\"}", 400)
                    found = self.recent.get(ident)
                    if found is None:
                        raise HttpError(404, f"prediction {ident[:64]!r} is not known (or no longer kept: the "
                                        "service keeps the most recent ones, prediction_memory_mb); post the image "
                                        "with ?label= instead")
                    raw, label = found[0][None], label_
                else:
                    label = query_label or ""
                    if ctype == "application/json":  # {"array": ..., "label": ...} is accepted too
                        with contextlib.suppress(ValueError):
                            obj = json.loads(body)
                            label = obj.get("label", label) if isinstance(obj, dict) else label
                    if not isinstance(label, str) or not label:
                        raise InputRejected("a sample needs its label: POST /v1/samples?label=NAME with the image "
                                            "or array as the body (or JSON {\"prediction_id\", \"label\"})", 400)
                    store.check_label(label)  # before decoding: a typo costs nothing
                    raw = decode(body, model.predictor.spec, content_type=content_type,
                                 max_pixels=self.limits.max_image_pixels, max_samples=1)
                stored = store.add(raw[0], label)
                if stored.status != "duplicate":
                    self.new_samples += 1
                return {"status": stored.status, "sample": stored.sample_hash, "label": stored.label,
                        "held_out": stored.held_out, "evicted": len(stored.evicted),
                        "corrects": correction.get("prediction_id") if correction else None,
                        "samples": len(store)}

        return self._timed(work)

    def model_info(self) -> dict[str, Any]:
        info = self.manager.describe()
        info["samples"] = (None if self.samples is None else
                           {"total": len(self.samples), "bytes": self.samples.total_bytes,
                            "per_label": self.samples.counts(), "new_since_finetune": self.new_samples})
        info["inference_energy"] = self.energy.to_json()
        info["finetune"] = None if self.finetune is None else {
            "running": self.finetune.running, "job": self.finetune.job or None, "last": self.finetune.last or None,
            "after_samples": self.finetune_after}
        info["requests"] = dict(self.stats)
        return info

    def start_finetune(self) -> dict[str, Any]:
        if self.finetune is None:
            raise HttpError(503, "local fine-tuning is off ([serve] personal = false, or no [data] dir)")
        found = self.manager.installed()
        if found is None:
            raise HttpError(503, "no model installed to fine-tune")
        if self.finetune.running:
            raise HttpError(409, f"a local fine-tune is already running ({self.finetune.job.get('id')})")
        name, version, path = found
        samples = len(self.samples) if self.samples is not None else 0
        self.new_samples = 0
        return self.finetune.start(name=name, version=version, bundle_dir=path, samples=samples)

    def tick(self) -> None:
        """The background loop's step: collect a finished fine-tune, start one when enough
        new samples came in, re-judge the served model."""
        if self.finetune is not None:
            if self.finetune.poll() is not None:
                self.on_change()
            if (self.finetune_after and self.new_samples >= self.finetune_after and not self.finetune.running
                    and self.manager.installed() is not None):
                try:
                    self.start_finetune()
                except HttpError as exc:
                    log.info("serve: automatic fine-tune not started: %s", exc.message)
        if self.samples is not None:
            self.samples.prune()
        if self.manager.refresh():
            self.on_change()
        self.energy.flush()


# ---------------------------------------------------------------- HTTP (Starlette)


async def read_body(request: Any, limits: ServiceLimits) -> bytes:
    """The body within the size and time limits (413 / 408), never more in memory."""
    length = request.headers.get("content-length")
    if length is not None:
        if not length.isdigit():
            raise HttpError(400, f"Content-Length {length[:32]!r} is not a number")
        if int(length) > limits.max_body_bytes:
            raise HttpError(413, f"body of {int(length)} bytes is over the limit of {limits.max_body_bytes} "
                            "(max_body_mb)")
    chunks, size = [], 0
    deadline = time.monotonic() + limits.read_timeout_s
    stream = request.stream().__aiter__()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise HttpError(408, f"the body did not arrive within {limits.read_timeout_s:g} s (read_timeout_s)")
        try:
            chunk = await asyncio.wait_for(stream.__anext__(), remaining)
        except StopAsyncIteration:
            break
        except TimeoutError:
            raise HttpError(408, f"the body did not arrive within {limits.read_timeout_s:g} s (read_timeout_s)") from None
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise HttpError(413, f"body over the limit of {limits.max_body_bytes} bytes (max_body_mb)")
        chunks.append(chunk)
    return b"".join(chunks)


def make_app(service: InferenceService, *, token: str | None = None) -> Any:
    """The Starlette app; with `token`, every request must send `Authorization: Bearer TOKEN`."""
    from starlette.applications import Starlette
    from starlette.requests import ClientDisconnect
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    limits = service.limits

    def error(status: int, message: str, headers: dict[str, str] | None = None) -> Any:
        return JSONResponse({"error": message, "status": status}, status_code=status, headers=headers)

    def handler(fn: Callable[[Any], Any], *, admit: bool = True) -> Callable[[Any], Any]:
        async def endpoint(request: Any) -> Any:
            if token is not None:
                sent = request.headers.get("authorization", "")
                if not hmac.compare_digest(sent.encode(), f"Bearer {token}".encode()):
                    return error(401, "missing or wrong bearer token (Authorization: Bearer ...)",
                                 {"WWW-Authenticate": "Bearer"})
            try:
                if admit:
                    service.admit()
                try:
                    result = await fn(request)
                finally:
                    if admit:
                        service.release()
            except HttpError as exc:
                service.stats[f"http_{exc.status}"] += 1
                return error(exc.status, exc.message, exc.headers)
            except InputRejected as exc:
                service.stats[f"http_{exc.status}"] += 1
                return error(exc.status, str(exc))
            except UnknownLabel as exc:
                service.stats["http_422"] += 1
                return error(422, str(exc))
            except InputError as exc:
                service.stats["http_422"] += 1
                return error(422, str(exc))
            except LookupError as exc:
                return error(503, str(exc), {"Retry-After": "5"})
            except ClientDisconnect:
                service.stats["client_disconnect"] += 1
                return error(400, "the client went away before the body was complete")
            except Exception as exc:  # noqa: BLE001 - a bug must not take the service down
                log.exception("serve: %s %s failed", request.method, request.url.path)
                service.stats["http_500"] += 1
                return error(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}")
            status, body = result if isinstance(result, tuple) else (200, result)
            service.stats[f"http_{status}"] += 1
            return JSONResponse(body, status_code=status)

        return endpoint

    def k_param(request: Any) -> int:
        text = request.query_params.get("k", str(limits.top_k))
        if not text.isdigit() or not 1 <= int(text) <= 100:
            raise HttpError(400, f"k={text[:16]!r}: a whole number from 1 to 100")
        return int(text)

    async def predict(request: Any) -> Any:
        k = k_param(request)
        body = await read_body(request, limits)
        return await service.run(service.predict, body, request.headers.get("content-type", ""), k)

    async def samples(request: Any) -> Any:
        label = request.query_params.get("label")
        body = await read_body(request, limits)
        result = await service.run(service.add_sample, body, request.headers.get("content-type", ""), label)
        return (200 if result["status"] == "duplicate" else 201), result

    async def model(request: Any) -> Any:
        return service.model_info()

    async def finetune(request: Any) -> Any:
        return 202, await service.run(service.start_finetune)

    async def health(request: Any) -> Any:
        current = service.manager.slot.current
        if current is None:
            raise HttpError(503, "no model served yet", {"Retry-After": "5"})
        return {"status": "ok", "model": current.version}

    routes = [Route("/v1/predict", handler(predict), methods=["POST"]),
              Route("/v1/samples", handler(samples), methods=["POST"]),
              Route("/v1/model", handler(model, admit=False), methods=["GET"]),
              Route("/v1/finetune", handler(finetune, admit=False), methods=["POST"]),
              Route("/v1/health", handler(health, admit=False), methods=["GET"])]

    async def not_found(request: Any, exc: Exception) -> Any:
        code = getattr(exc, "status_code", 404)
        what = "method not allowed" if code == 405 else "no such endpoint"
        return error(code, f"{request.method} {request.url.path}: {what}; see GET /v1/model, POST /v1/predict, "
                     "POST /v1/samples, POST /v1/finetune")

    return Starlette(routes=routes, exception_handlers={404: not_found, 405: not_found})
