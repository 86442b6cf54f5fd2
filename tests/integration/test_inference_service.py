"""The local inference service as an application sees it: a real `edge-agent serve`
process, driven over its Unix socket by real HTTP clients (httpx and curl) -- predictions,
samples, corrections, every bad input, overload, slow clients, kill -9 during a sample
upload and a hot swap under load. No broker: the service needs none."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from edge_agent.data import load_dataset
from edge_agent.int8.bundle import load_bundle
from tests.conftest import new_head_version

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from edge_agent.sim import scenario as demo

    return demo.ensure_bundle(tmp_path_factory.getbasetemp() / "digits-bundle")


@pytest.fixture(scope="module")
def device() -> tuple[np.ndarray, list[str]]:
    from edge_agent.sim import scenario as demo

    dev = demo.scenario().devices[1]
    return demo.to_pixels(dev.images).astype(np.float32), [demo.LABELS[v] for v in dev.labels]


def _png(pixels: np.ndarray) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(pixels, np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


class Service:
    """`edge-agent serve` on a fresh state directory with `bundle` installed as version 1."""

    def __init__(self, root: Path, bundle: Path, **serve: object) -> None:
        from edge_agent import keys
        from edge_agent.config import public_key_text

        self.root, self.state, self.data = root, root / "state", root / "data"
        self.sock = root / "inference.sock"
        models = self.state / "models" / "digits-cnn"
        if not models.exists():
            models.mkdir(parents=True)
            import shutil

            shutil.copytree(bundle, models / "1")
            os.symlink("1", models / "current")
        settings = {"enabled": True, "socket": str(self.sock), "engine": "native", "refresh_s": 0.2, **serve}
        lines = "\n".join(f"{k} = {json.dumps(v)}" for k, v in settings.items())
        key = public_key_text(keys.generate_private_key().public_key())
        self.config = root / "agent.toml"
        self.config.write_text(f'[device]\nname = "dev"\nstate_dir = "{self.state}"\nprofile = "raspberry-pi-4"\n'
                               f'[broker]\nhost = "127.0.0.1"\n[coordinator]\npublic_key = "{key}"\n'
                               f'[data]\ndir = "{self.data}"\n[serve]\n{lines}\n')
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Service:
        with open(self.root / "serve.log", "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "edge_agent.cli", "serve", "--config",
                                          str(self.config)], cwd=REPO, stdout=subprocess.DEVNULL, stderr=log)
        deadline = time.monotonic() + 120  # bounds a hang only: progress is the socket answering
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, (self.root / "serve.log").read_text()[-2000:]
            if self.sock.exists() and self._accepting():
                try:
                    with self.client() as c:  # closed: an unclosed one is another test's ResourceWarning
                        if c.get("/v1/health").status_code == 200:
                            return self
                except httpx.TransportError:
                    pass
            time.sleep(0.1)
        raise AssertionError("the service did not come up")

    def _accepting(self) -> bool:
        """Whether something listens on the socket: a stale one (after kill -9) refuses, and
        httpx's failed connect would leave its socket unclosed (a ResourceWarning later)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(self.sock))
            except OSError:
                return False
        return True

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.sock)), base_url="http://edge", timeout=timeout)

    def curl(self, *args: str) -> tuple[int, dict]:
        out = subprocess.run(["curl", "-s", "-w", "\n%{http_code}", "--unix-socket", str(self.sock), *args],
                             capture_output=True, check=True)
        body, _, code = out.stdout.decode().rpartition("\n")
        return int(code), json.loads(body)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory, bundle_dir: Path):
    svc = Service(tmp_path_factory.mktemp("svc"), bundle_dir, max_image_pixels=10_000, read_timeout_s=1.0,
                  max_inflight=1).start()
    yield svc
    svc.stop()


def test_an_application_predicts_posts_samples_and_corrects_over_the_socket(service: Service, device,
                                                                             tmp_path: Path) -> None:
    x, y = device
    image = tmp_path / "seen.png"
    image.write_bytes(_png(x[0][0]))
    code, out = service.curl("-X", "POST", "--data-binary", f"@{image}", "-H", "Content-Type: image/png",
                             "http://edge/v1/predict?k=2")
    assert code == 200 and out["model"]["version"] == "digits-cnn/1" and out["latency_ms"] > 0
    assert len(out["predictions"]) == 1 and len(out["predictions"][0]["top"]) == 2
    with service.client() as c:
        batch = c.post("/v1/predict", content=_npy(x[:5]), headers={"Content-Type": "application/x-npy"}).json()
        assert len(batch["predictions"]) == 5 and batch["predictions"][0]["label"] == out["predictions"][0]["label"]
        first = c.post(f"/v1/samples?label={y[1]}", content=_npy(x[1]))
        assert first.status_code == 201 and first.json()["status"] == "stored"
        again = c.post(f"/v1/samples?label={y[1]}", content=_npy(x[1]))
        assert again.status_code == 200 and again.json()["status"] == "duplicate"
        pid = batch["predictions"][2]["id"]
        fixed = c.post("/v1/samples", json={"prediction_id": pid, "label": y[2]})
        assert fixed.status_code == 201 and fixed.json()["corrects"] == pid and fixed.json()["label"] == y[2]
        assert c.post("/v1/samples", json={"prediction_id": "f" * 32, "label": "1"}).status_code == 404
        info = c.get("/v1/model").json()
    assert info["served"]["version"] == "digits-cnn/1" and info["served"]["tail"] == "numpy-dense"
    assert info["samples"]["total"] >= 2 and info["inference_energy"]["requests"] >= 3
    data = load_dataset(service.data, load_bundle(service.state / "models/digits-cnn/1").manifest.input,
                        [str(i) for i in range(10)])
    assert len(data) == info["samples"]["total"]  # what the next fine-tune reads


def _raw_request(sock_path: Path, head: bytes) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(str(sock_path))
    s.sendall(head)
    return s


def _response(s: socket.socket) -> tuple[int, dict]:
    s.settimeout(60)
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < int(
            dict(line.split(b": ", 1) for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]
                 if b": " in line).get(b"content-length", b"0")):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


@pytest.mark.parametrize("case, status, words", [
    ("not-an-image", 415, "not an image"),
    ("huge", 413, "pixels"),
    ("unknown-label", 422, "'cat' is not one of the model's labels"),
    ("no-label", 400, "needs its label"),
    ("wrong-shape", 422, "the model takes (1, 8, 8)"),
    ("too-big", 413, "over the limit"),
    ("bad-k", 400, "k="),
    ("no-endpoint", 404, "no such endpoint"),
])
def test_every_bad_input_gets_a_clear_4xx_and_the_service_stays_up(service: Service, case: str, status: int,
                                                                   words: str, device) -> None:
    x = device[0]
    path, body, ctype = {
        "not-an-image": ("/v1/predict", b"GIF89a? no: plain junk bytes", "application/octet-stream"),
        "huge": ("/v1/predict", _png(np.zeros((200, 200))), "image/png"),  # 40,000 px over max_image_pixels
        "unknown-label": ("/v1/samples?label=cat", _npy(x[0]), "application/x-npy"),
        "no-label": ("/v1/samples", _npy(x[0]), "application/x-npy"),
        "wrong-shape": ("/v1/predict", _npy(np.zeros((3, 3))), "application/x-npy"),
        "too-big": ("/v1/predict", b"0" * (9 << 20), "application/x-npy"),
        "bad-k": ("/v1/predict?k=zero", _npy(x[0]), "application/x-npy"),
        "no-endpoint": ("/v1/nothing", b"", "application/x-npy"),
    }[case]
    with service.client() as c:
        r = c.post(path, content=body, headers={"Content-Type": ctype})
        assert r.status_code == status and words in r.json()["error"], r.text
        ok = c.post("/v1/predict", content=_npy(x[0]))
        assert ok.status_code == 200  # still up, still serving


def test_a_slow_client_gets_408_and_overload_gets_429(service: Service, device) -> None:
    body = _npy(device[0][0])
    head = (f"POST /v1/predict HTTP/1.1\r\nHost: edge\r\nContent-Type: application/x-npy\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    slow = _raw_request(service.sock, head + body[:20])  # admitted: holds the one in-flight place (max_inflight 1)
    try:
        with service.client() as c:
            deadline = time.monotonic() + 30
            while True:  # the slow request is admitted once the server has read its headers
                r = c.post("/v1/predict", content=body)
                if r.status_code == 429 or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            assert r.status_code == 429 and r.headers["retry-after"] == "1" and "overloaded" in r.json()["error"]
        status, out = _response(slow)  # it never sends the rest: read_timeout_s 1
        assert status == 408 and "did not arrive" in out["error"]
    finally:
        slow.close()
    with service.client() as c:
        assert c.post("/v1/predict", content=body).status_code == 200


def test_kill_9_during_a_sample_upload_loses_no_acknowledged_sample(tmp_path: Path, bundle_dir: Path, device) -> None:
    x, y = device
    svc = Service(tmp_path, bundle_dir).start()
    acked = []
    try:
        with svc.client() as c:
            for i in range(12):
                r = c.post(f"/v1/samples?label={y[i]}", content=_npy(x[i]))
                assert r.status_code == 201
                acked.append(r.json()["sample"])
        body = _npy(x[20])
        cut = _raw_request(svc.sock, (f"POST /v1/samples?label={y[20]} HTTP/1.1\r\nHost: edge\r\n"
                                      f"Content-Length: {len(body)}\r\n\r\n").encode() + body[:len(body) // 2])
        try:
            svc.stop(signal.SIGKILL)
        finally:
            cut.close()
    finally:
        svc.stop()
    spec = load_bundle(bundle_dir).manifest.input
    data = load_dataset(svc.data, spec, [str(i) for i in range(10)])
    assert sorted(data.hashes) == sorted(acked) and data.report.skipped_total == 0  # nothing partial, nothing lost
    svc.start()  # and the service comes back over the stale socket with every sample
    try:
        with svc.client() as c:
            assert c.get("/v1/model").json()["samples"]["total"] == 12
            r = c.post(f"/v1/samples?label={y[20]}", content=_npy(x[20]))
            assert r.status_code == 201
    finally:
        svc.stop()


def test_a_hot_swap_under_load_fails_no_request_and_each_names_its_version(tmp_path: Path, bundle_dir: Path,
                                                                          device) -> None:
    svc = Service(tmp_path, bundle_dir, max_inflight=64).start()
    x = device[0]
    results: list[tuple[int, str]] = []
    stop = threading.Event()

    def hammer(offset: int) -> None:
        with svc.client() as c:
            i = offset
            while not stop.is_set():
                r = c.post("/v1/predict", content=_npy(x[i % len(x)]))
                results.append((r.status_code, r.json().get("model", {}).get("version", "")))
                i += 1

    threads = [threading.Thread(target=hammer, args=(k,)) for k in range(3)]
    try:
        for t in threads:
            t.start()
        while len(results) < 30:
            time.sleep(0.05)
        models = svc.state / "models" / "digits-cnn"
        new_head_version(bundle_dir, models / "2", version="2", shift=0.01)
        os.symlink("2", models / "current.new")
        os.replace(models / "current.new", models / "current")  # what the agent's model store does
        deadline = time.monotonic() + 120  # bounds a hang: progress is v2 answering
        while not any(v == "digits-cnn/2" for _, v in results[-50:]) and time.monotonic() < deadline:
            time.sleep(0.05)
        seen = len(results)
        while len(results) < seen + 30:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(60)
        svc.stop()
    assert [s for s, _ in results if s != 200] == []
    versions = [v for _, v in results]
    assert set(versions) == {"digits-cnn/1", "digits-cnn/2"}
    last_v1 = max(i for i, v in enumerate(versions) if v == "digits-cnn/1")
    first_v2 = versions.index("digits-cnn/2")
    assert last_v1 < first_v2 + 3 * 2  # at most the requests in flight at the swap answered by v1 after it


def test_a_local_fine_tune_yields_and_its_personal_model_is_served_only_where_better(tmp_path: Path, bundle_dir: Path,
                                                                                      device) -> None:
    """The job runs at "normal" priority here (the setting reaches the job): at the default,
    "idle" (SCHED_IDLE, pinned in tests/unit/test_inference.py), it gets no CPU while other
    processes keep the machine busy, as CI's parallel load once did for 240 s -- by design;
    test_lower_priority_puts_a_process_below_inference checks that mechanism."""
    x, y = device
    svc = Service(tmp_path, bundle_dir, training_priority="normal").start()
    try:
        with svc.client() as c:
            for i in range(60):
                assert c.post(f"/v1/samples?label={y[i]}", content=_npy(x[i])).status_code == 201
            started = c.post("/v1/finetune")
            assert started.status_code == 202 and started.json()["priority"] == "normal"
            assert c.post("/v1/finetune").status_code in (409, 202)  # one at a time (409 while it runs)
            deadline = time.monotonic() + 240  # bounds a hang: progress is the job's own outcome
            info = c.get("/v1/model").json()
            while time.monotonic() < deadline and not (info["finetune"]["last"] and info["personal"]):
                time.sleep(0.2)
                info = c.get("/v1/model").json()
            assert info["finetune"]["last"]["status"] == "installed", info["finetune"]
            fleet, personal = info["fleet"]["held_out_accuracy"], info["personal"]["held_out_accuracy"]
            served = c.post("/v1/predict", content=_npy(x[100])).json()["model"]
        assert info["personal"]["version"].startswith("digits-cnn/1+p")
        assert served["kind"] == ("personal" if personal > fleet else "fleet")
        assert served["version"] == info["served"]["version"]
        assert list((svc.state / "personal" / "digits-cnn" / "1").iterdir())  # kept on disk, beside the fleet version
    finally:
        svc.stop()


def test_lower_priority_puts_a_process_below_inference(tmp_path: Path) -> None:
    from edge_agent.inference.personal import lower_priority

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lower_priority(child.pid, "idle")
        assert os.sched_getscheduler(child.pid) == os.SCHED_IDLE
        assert os.getpriority(os.PRIO_PROCESS, child.pid) == 19
    finally:
        child.kill()
        child.wait()
