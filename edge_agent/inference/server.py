"""Running the local inference service: HTTP on a Unix socket (and optionally 127.0.0.1 with
a bearer token), uvicorn in a thread of the daemon (or of `edge-agent serve` alone), plus a
background loop that re-judges the served model and collects local fine-tunes.

    server = InferenceServer.from_config(config, probe=report)
    server.start() ... server.facts() ... server.stop()

The socket is created here before uvicorn starts: mode 0660, group `socket_group` (the
application's), in a directory others may traverse -- so a permission problem or a path in
use is a clear error at start, not a log line later. A stale socket file (a previous run
killed) is replaced; a live one (another service answering) is refused.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import socket
import stat
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..power.inference_energy import ENERGY_FILE, InferenceEnergy
from .service import InferenceService, ServiceLimits, make_app
from .serving import ModelManager

log = logging.getLogger(__name__)
MIN_TOKEN_CHARS = 16
DEFAULT_SOCKET = "inference.sock"


def default_socket(state_dir: Path) -> Path:
    """systemd's RuntimeDirectory (/run/edge-agent: the unit makes it traversable, the state
    directory is not) when the service runs under it, else the state directory."""
    runtime = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
    return Path(runtime) / DEFAULT_SOCKET if runtime else Path(state_dir) / DEFAULT_SOCKET


def read_token(path: str | Path) -> str:
    try:
        raw = Path(path).read_bytes()[:4097]
    except OSError as exc:
        raise ConfigError(f"[serve] token_file {path}: {exc.strerror or exc}") from None
    text = raw.decode("utf-8", "replace").strip().splitlines()
    token = text[0].strip() if text else ""
    if len(raw) > 4096 or len(token) < MIN_TOKEN_CHARS or not token.isprintable() or " " in token:
        raise ConfigError(f"[serve] token_file {path}: the token must be one line of at least {MIN_TOKEN_CHARS} "
                          "printable characters without spaces (e.g. `openssl rand -hex 24`)")
    return token


def bind_unix(path: Path, group: str | None) -> socket.socket:
    """A listening Unix socket at `path`, mode 0660 (group `group` when given)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"[serve] socket {path}: exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # stale: left by a run that was killed
        else:
            raise ConfigError(f"[serve] socket {path}: another service is listening there")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)  # never world-accessible, not even between bind and chmod
    try:
        sock.bind(str(path))
    except OSError as exc:
        sock.close()
        raise ConfigError(f"[serve] socket {path}: cannot listen there ({exc.strerror or exc})") from None
    finally:
        os.umask(old)
    os.chmod(path, 0o660)
    if group:
        try:
            os.chown(path, -1, grp.getgrnam(group).gr_gid)
        except (KeyError, OSError) as exc:
            sock.close()
            raise ConfigError(f"[serve] socket_group {group!r}: cannot give it the socket ({exc})") from None
    sock.listen(128)
    return sock


def bind_tcp(port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"[serve] port {port}: cannot listen on 127.0.0.1:{port} ({exc.strerror or exc})") from None
    return sock


@dataclass
class ServeOptions:
    state_dir: Path
    data_dir: Path | None
    socket_path: Path
    socket_group: str | None = None
    port: int = 0
    token: str | None = None
    model: str | None = None
    engine: str | None = None
    limits: ServiceLimits = ServiceLimits()
    samples_per_label: int = 1000
    samples_max_bytes: int = 256 << 20
    samples_max_age_days: float | None = None
    guard_tolerance: float = 0.02
    personal: bool = True
    finetune_after: int = 0
    finetune_budget_wh: float | None = None
    finetune_args: tuple[str, ...] = ()
    training_priority: str = "idle"
    refresh_s: float = 2.0
    probe: dict[str, Any] | None = None

    @classmethod
    def from_config(cls, config: Any, *, probe: dict[str, Any] | None = None) -> ServeOptions:
        g = config.get
        state = config.state_dir
        data = g("data", "dir")
        token_file = g("serve", "token_file")
        return cls(
            state_dir=state, data_dir=Path(data) if data else None,
            socket_path=Path(g("serve", "socket") or default_socket(state)), socket_group=g("serve", "socket_group"),
            port=int(g("serve", "port", 0)), token=read_token(token_file) if token_file else None,
            model=g("serve", "model"), engine=g("serve", "engine"),
            limits=ServiceLimits(top_k=int(g("serve", "top_k")), max_body_bytes=int(float(g("serve", "max_body_mb")) * (1 << 20)),
                                 max_image_pixels=int(g("serve", "max_image_pixels")), max_batch=int(g("serve", "max_batch")),
                                 max_inflight=int(g("serve", "max_inflight")), read_timeout_s=float(g("serve", "read_timeout_s")),
                                 prediction_memory_bytes=int(float(g("serve", "prediction_memory_mb")) * (1 << 20))),
            samples_per_label=int(g("serve", "samples_per_label")),
            samples_max_bytes=int(float(g("serve", "samples_max_mb")) * (1 << 20)),
            samples_max_age_days=g("serve", "samples_max_age_days"), guard_tolerance=float(g("serve", "guard_tolerance")),
            personal=bool(g("serve", "personal")), finetune_after=int(g("serve", "finetune_after_samples")),
            finetune_budget_wh=g("serve", "finetune_budget_wh"), training_priority=str(g("serve", "training_priority")),
            refresh_s=float(g("serve", "refresh_s")), probe=probe)


class InferenceServer:
    """The service's parts wired together, and its threads."""

    def __init__(self, options: ServeOptions) -> None:
        from .personal import LocalFineTune
        from .predictor import engine_settings, open_predictor
        from .samples import SampleStore

        o = self.options = options
        probe = o.probe
        if probe is None and not o.engine:
            from ..int8.selection import default_probe

            probe = default_probe()
        wpc = engine_settings(probe).get("watts_per_cpu") if probe else None
        self.energy = InferenceEnergy(watts_per_cpu=wpc, path=o.state_dir / ENERGY_FILE)

        def loader(bundle: Any, depth: int, params: Any, prefix: Path | None) -> Any:
            return open_predictor(bundle, depth=depth, params=params, engine=o.engine, state_dir=o.state_dir / "cache",
                                  probe=probe, prefix=prefix)

        self.samples: SampleStore | None = None

        def samples_factory(predictor: Any) -> SampleStore:
            assert o.data_dir is not None
            return SampleStore(root=o.data_dir, spec=predictor.spec, labels=predictor.labels,
                               max_per_label=o.samples_per_label, max_bytes=o.samples_max_bytes,
                               max_age_days=o.samples_max_age_days)

        def held_out() -> Any:
            import numpy as np

            store = self.service.samples
            if store is None:
                return np.empty((0, 1, 1, 1), np.float32), np.empty(0, np.int64)
            return store.held_out_set()

        self.manager = ModelManager(models_root=o.state_dir / "models", personal_root=o.state_dir / "personal",
                                    name=o.model, loader=loader, held_out=held_out,
                                    held_out_version=lambda: self.service.samples.version if self.service.samples else 0,
                                    tolerance=o.guard_tolerance, personal=o.personal)
        finetune = None
        if o.personal and o.data_dir is not None:
            finetune = LocalFineTune(state_dir=o.state_dir, personal_root=o.state_dir / "personal", data_dir=o.data_dir,
                                     priority=o.training_priority, budget_wh=o.finetune_budget_wh,
                                     extra_args=list(o.finetune_args))
        self.service = InferenceService(manager=self.manager, limits=o.limits,
                                        samples_factory=samples_factory if o.data_dir is not None else None,
                                        energy=self.energy, finetune=finetune, finetune_after=o.finetune_after,
                                        on_change=self._changed)
        self.changed = False
        self._servers: list[Any] = []
        self._threads: list[threading.Thread] = []
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []

    @classmethod
    def from_config(cls, config: Any, *, probe: dict[str, Any] | None = None) -> InferenceServer:
        return cls(ServeOptions.from_config(config, probe=probe))

    def _changed(self) -> None:
        self.changed = True

    def refresh(self) -> None:
        """Load / re-judge now (also run by the background loop every refresh_s)."""
        self.service.tick()
        current = self.manager.slot.current
        if current is not None and self.service.samples is None and self.options.data_dir is not None:
            self.service.sample_store(current)  # the held-out set exists from the start
            self.manager.refresh()

    def _loop(self) -> None:
        while not self._stop.wait(self.options.refresh_s):
            try:
                self.refresh()
            except Exception:  # noqa: BLE001 - logged; the service keeps answering with what it has
                log.exception("serve: background refresh failed")

    def start(self) -> None:
        try:
            import uvicorn
        except ImportError as exc:
            raise ConfigError(f"[serve] needs uvicorn and starlette ({exc.name} is missing): reinstall edge-agent") from None
        o = self.options
        self.refresh()
        binds = [(bind_unix(o.socket_path, o.socket_group), None)]
        if o.port:
            binds.append((bind_tcp(o.port), o.token))
        self._sockets = [s for s, _ in binds]
        for sock, token in binds:
            app = make_app(self.service, token=token)
            config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", server_header=False,
                                    timeout_keep_alive=5, limit_concurrency=max(64, 4 * o.limits.max_inflight),
                                    h11_max_incomplete_event_size=16 * 1024, http="h11", loop="asyncio", ws="none")
            server = uvicorn.Server(config)
            thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True,
                                      name=f"edge-serve-{'tcp' if token else 'unix'}")
            thread.start()
            self._servers.append(server)
            self._threads.append(thread)
        deadline = time.monotonic() + 60
        while not all(s.started for s in self._servers) and time.monotonic() < deadline:
            if not all(t.is_alive() for t in self._threads):
                raise ConfigError("[serve]: the HTTP server did not start (see the log)")
            time.sleep(0.02)
        loop = threading.Thread(target=self._loop, daemon=True, name="edge-serve-refresh")
        loop.start()
        self._threads.append(loop)
        log.info("local inference service on %s%s", o.socket_path, f" and 127.0.0.1:{self.port} (token)" if o.port else "")

    @property
    def port(self) -> int:
        for sock in self._sockets:
            if sock.family == socket.AF_INET:
                return int(sock.getsockname()[1])
        return 0

    def facts(self) -> dict[str, Any]:
        """What the device's state message reports (protocol schema: `inference`)."""
        m = self.manager
        current = m.slot.current
        out: dict[str, Any] = {}
        if current is not None:
            out.update(served_model=current.version[:160], served_kind=current.kind, held_out=int(current.judged_on))
        for key, model in (("fleet_accuracy", m.fleet), ("personal_accuracy", m.personal_model)):
            if model is not None and model.accuracy is not None:
                out[key] = round(float(model.accuracy), 4)
        out["inference_wh"] = round(self.energy.joules / 3600.0, 6)
        out["inference_requests"] = int(self.energy.requests)
        return out

    def stop(self) -> None:
        self._stop.set()
        for server in self._servers:
            server.should_exit = True
        for thread in self._threads:
            thread.join(timeout=10)
        if self.service.finetune is not None:
            self.service.finetune.stop()
        self.service.pool.shutdown(wait=True, cancel_futures=True)
        with contextlib.suppress(Exception):
            self.energy.flush()
        for sock in self._sockets:
            sock.close()
        with contextlib.suppress(FileNotFoundError):
            self.options.socket_path.unlink()
