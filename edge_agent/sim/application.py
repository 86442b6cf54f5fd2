"""An application on the device that uses the agent's local inference service: it
classifies what its camera sees through the Unix socket and posts labelled feedback (a
confirmed detection, an operator's correction), and the device learns from it.

`LocalClient` is what an application would write: plain HTTP over the socket (the standard
library's http.client; any HTTP client with Unix-socket support does, e.g. curl
--unix-socket or httpx). `feedback_round` is the loop the demo and bench_inference measure:

    1. predict the application's next samples (accuracy BEFORE, served model named);
    2. post N labelled samples (corrections of the wrong predictions by prediction id, the
       right ones confirmed with their label) -- stored into the device's data set;
    3. one local fine-tune (POST /v1/finetune), wait until the device has judged its result;
    4. predict the same next samples again (accuracy AFTER, and which model answered).
"""

from __future__ import annotations

import http.client
import io
import json
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


class ServiceError(RuntimeError):
    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {body.get('error', body)}")
        self.status, self.body = status, body


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self.socket_path)
        self.sock = sock


def npy_bytes(raw: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.asarray(raw), allow_pickle=False)
    return buf.getvalue()


class LocalClient:
    """The local inference service over its Unix socket (one keep-alive connection)."""

    def __init__(self, socket_path: str, *, timeout: float = 120.0) -> None:
        self.socket_path, self.timeout = str(socket_path), timeout
        self._conn: _UnixConnection | None = None

    def request(self, method: str, path: str, body: bytes | None = None,
                content_type: str = "application/x-npy") -> tuple[int, dict[str, Any]]:
        for attempt in (0, 1):  # a keep-alive connection the server closed is reopened once
            if self._conn is None:
                self._conn = _UnixConnection(self.socket_path, self.timeout)
            try:
                headers = {"Content-Type": content_type} if body is not None else {}
                self._conn.request(method, path, body=body, headers=headers)
                resp = self._conn.getresponse()
                data = resp.read()
                return resp.status, json.loads(data) if data else {}
            except (ConnectionError, http.client.RemoteDisconnected, http.client.CannotSendRequest):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _ok(self, status: int, body: dict[str, Any]) -> dict[str, Any]:
        if status >= 400:
            raise ServiceError(status, body)
        return body

    def predict(self, raw: np.ndarray, k: int = 1) -> dict[str, Any]:
        return self._ok(*self.request("POST", f"/v1/predict?k={k}", npy_bytes(raw)))

    def post_sample(self, raw: np.ndarray, label: str) -> dict[str, Any]:
        from urllib.parse import quote

        return self._ok(*self.request("POST", f"/v1/samples?label={quote(label)}", npy_bytes(raw)))

    def correct(self, prediction_id: str, label: str) -> dict[str, Any]:
        body = json.dumps({"prediction_id": prediction_id, "label": label}).encode()
        return self._ok(*self.request("POST", "/v1/samples", body, "application/json"))

    def model(self) -> dict[str, Any]:
        return self._ok(*self.request("GET", "/v1/model"))

    def finetune(self) -> dict[str, Any]:
        return self._ok(*self.request("POST", "/v1/finetune", b"", "application/json"))

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


@dataclass
class RoundResult:
    device: str
    posted: int
    held_out_posted: int
    before: float
    after: float
    served_before: str
    served_after: str
    fleet_accuracy: float | None
    personal_accuracy: float | None
    finetune: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return dict(self.__dict__)


def accuracy(client: LocalClient, x: np.ndarray, y: list[str]) -> tuple[float, str]:
    """Top-1 accuracy of the served model on (x, y) through the service; the version that answered."""
    right, versions = 0, set()
    for i in range(0, len(x), 64):
        out = client.predict(x[i:i + 64])
        versions.add(out["model"]["version"])
        right += sum(p["label"] == label for p, label in zip(out["predictions"], y[i:i + 64], strict=True))
    return right / max(1, len(x)), ",".join(sorted(versions))


SLOW_FINETUNE_S = 60.0  # the demo's local fine-tune takes a few CPU-seconds on an idle machine


def wait_for_finetune(client: LocalClient, *, timeout_s: float = 900.0, poll_s: float = 0.5,
                      say: Callable[[str], None] | None = None, notice_after_s: float = SLOW_FINETUNE_S) -> dict[str, Any]:
    """Until the local fine-tune has finished and the device has judged its result; `say`
    hears once, after `notice_after_s`, that it is still running and why it may be slow."""
    start = time.monotonic()
    deadline = start + timeout_s
    noticed = say is None
    while time.monotonic() < deadline:
        info = client.model()
        ft = info.get("finetune") or {}
        if not noticed and ft.get("running") and time.monotonic() - start >= notice_after_s:
            noticed = True
            say(f"the local fine-tune is still running after {notice_after_s:.0f} s: it trains at idle priority "
                "([serve] training_priority = \"idle\"), so that predictions come first, and any other process keeping "
                "this machine busy gets the CPU before it")
        if not ft.get("running") and ft.get("last"):
            last = ft["last"]
            personal = info.get("personal") or {}
            if last.get("status") != "installed" or personal.get("held_out_accuracy") is not None \
                    or not (info.get("samples") or {}).get("total"):
                return info
        time.sleep(poll_s)
    raise TimeoutError(f"the local fine-tune did not finish within {timeout_s:g} s")


def feedback_round(client: LocalClient, device: str, feedback: tuple[np.ndarray, list[str]],
                   next_samples: tuple[np.ndarray, list[str]],
                   say: Callable[[str], None] | None = None) -> RoundResult:
    """One pass of the loop in the module doc; raw pixels in, labels as names; `say` hears
    why, if the fine-tune is slow (wait_for_finetune)."""
    fx, fy = feedback
    nx, ny = next_samples
    before, served_before = accuracy(client, nx, ny)
    held = 0
    for i in range(len(fx)):
        out = client.predict(fx[i:i + 1])
        pred = out["predictions"][0]
        stored = client.correct(pred["id"], fy[i]) if pred["label"] != fy[i] else client.post_sample(fx[i], fy[i])
        held += bool(stored.get("held_out"))
    client.finetune()
    info = wait_for_finetune(client, say=say)
    after, served_after = accuracy(client, nx, ny)
    fleet, personal = info.get("fleet") or {}, info.get("personal") or {}
    return RoundResult(device, len(fx), held, before, after, served_before, served_after,
                       fleet.get("held_out_accuracy"), personal.get("held_out_accuracy"),
                       (info.get("finetune") or {}).get("last") or {})


def demo_loop(out: Path, devices: dict[str, dict[str, Any]], say: Any, *, count: int = 2) -> list[dict[str, Any]]:
    """`make demo`'s last act: on `count` demo devices, the model each installed (the fleet
    version) is served by the local service on a copy of its state, an application posts
    half of what the device's camera sees with labels, the device fine-tunes once, and the
    served model's accuracy on the other half (the application's next samples) is printed."""
    import os
    import shutil

    from ..inference.server import InferenceServer, ServeOptions
    from ..sim import scenario as demo

    scenario = demo.scenario(n_devices=len(devices))
    rows = []
    say("the device uses what it learns: an application posts labelled samples over the local socket, "
        "the device fine-tunes, the served model answers its next samples")
    for (name, info), dev in list(zip(devices.items(), scenario.devices, strict=False))[:count]:
        installed = Path(info["state"]) / "models"
        link = next(installed.glob("*/current"), None)
        if link is None:
            continue
        home = out / "local-loop" / name
        shutil.rmtree(home, ignore_errors=True)
        models = home / "state" / "models" / link.parent.name
        models.mkdir(parents=True)
        version = os.readlink(link)
        shutil.copytree(link.parent / version, models / version)
        os.symlink(version, models / "current")
        server = InferenceServer(ServeOptions(state_dir=home / "state", data_dir=home / "data",
                                              socket_path=home / "inference.sock", refresh_s=0.25))
        server.start()
        client = LocalClient(str(home / "inference.sock"), timeout=600)
        try:
            x = demo.to_pixels(dev.images).astype(np.float32)
            y = [demo.LABELS[v] for v in dev.labels]
            n = len(x) // 2
            result = feedback_round(client, name, (x[:n], y[:n]), (x[n:], y[n:]), say=say)
        finally:
            client.close()
            server.stop()
        rows.append(result.to_json())
        say(f"{name}: {result.posted} samples posted, one local fine-tune: accuracy on its next {len(x) - n} samples "
            f"{100 * result.before:.1f} % ({result.served_before}) -> {100 * result.after:.1f} % "
            f"({result.served_after}; held-out: fleet {_pct(result.fleet_accuracy)}, personal "
            f"{_pct(result.personal_accuracy)})")
    (out / "local-loop.json").write_text(json.dumps(rows, indent=2, default=str) + "\n")
    return rows


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"
