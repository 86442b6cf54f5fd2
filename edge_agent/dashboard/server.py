"""Running the dashboard beside `edge-coordinator serve`: uvicorn in a daemon thread.

    ui = start_ui(state_dir, address="127.0.0.1:8080", token_file=None, policy=policy)
    ui.url ... ui.close()

The UI opens its own read-only registry connection (`mode=ro`), so it can never write, and
binds the socket itself before returning: a port in use is a clear error at startup, not
a log line later. Loopback binds need no token; any other address needs `--ui-token FILE`
(refused otherwise: exit 64), and then every request must present it.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UsageError

log = logging.getLogger(__name__)
MIN_TOKEN_CHARS = 16
MAX_TOKEN_BYTES = 4096


def parse_address(text: str) -> tuple[str, int]:
    """'127.0.0.1:8080', '[::1]:8080', ':8080' (loopback) -> (host, port); port 0 = any free."""
    host, sep, port = text.strip().rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UsageError(f"--ui {text!r}: expected ADDR:PORT, e.g. 127.0.0.1:8080")
    host = host.strip("[]") or "127.0.0.1"
    if host == "localhost":
        host = "127.0.0.1"
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise UsageError(f"--ui {text!r}: the address must be an IP address (e.g. 127.0.0.1)") from None
    return host, int(port)


def is_loopback(host: str) -> bool:
    return ipaddress.ip_address(host).is_loopback


def read_token(path: str | Path) -> str:
    """The bearer token from a file (first line, stripped); at least 16 characters."""
    try:
        raw = Path(path).read_bytes()[: MAX_TOKEN_BYTES + 1]
    except OSError as exc:
        raise UsageError(f"--ui-token {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_TOKEN_BYTES:
        raise UsageError(f"--ui-token {path}: longer than {MAX_TOKEN_BYTES} bytes")
    try:
        token = raw.decode("utf-8").strip().splitlines()[0].strip() if raw.strip() else ""
    except UnicodeDecodeError:
        raise UsageError(f"--ui-token {path}: not UTF-8 text") from None
    if len(token) < MIN_TOKEN_CHARS or not token.isprintable() or " " in token:
        raise UsageError(f"--ui-token {path}: the token must be at least {MIN_TOKEN_CHARS} printable characters "
                         "without spaces (e.g. `openssl rand -hex 24`)")
    return token


def check_ui_options(address: str, token_file: str | Path | None) -> tuple[str, int, str | None]:
    """Validate `--ui` / `--ui-token` before anything starts (UsageError: exit 64)."""
    host, port = parse_address(address)
    token = read_token(token_file) if token_file else None
    if token is None and not is_loopback(host):
        raise UsageError(f"--ui {address}: a non-loopback address needs --ui-token FILE (a bearer token)")
    return host, port, token


@dataclass
class UiServer:
    host: str
    port: int
    server: Any
    thread: threading.Thread
    registry: Any
    app: Any

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.registry.close()


def start_ui(state_dir: str | Path, *, address: str, token_file: str | Path | None = None,
             policy: Any = None, db: str | None = None) -> UiServer:
    """Start the dashboard on `address` in a daemon thread; returns once it accepts connections."""
    host, port, token = check_ui_options(address, token_file)
    try:
        import uvicorn

        from .app import make_app
    except ImportError as exc:
        raise ConfigError(f"--ui needs the dashboard's packages ({exc.name}): pip install '/path/to/checkout[ui]' (or the release wheel with [ui])") from None
    from ..coordinator.registry import Registry

    registry = Registry(state_dir=state_dir, read_only=True, db=db)  # db: as Registry's
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(64)
    except OSError as exc:
        sock.close()
        registry.close()
        raise ConfigError(f"--ui {address}: cannot listen there ({exc.strerror or exc})") from None
    app = make_app(registry, policy=policy, token=token, bind_host=host)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", server_header=False)
    server = uvicorn.Server(config)
    started = threading.Event()

    def run() -> None:
        try:
            server.run(sockets=[sock])
        finally:
            started.set()
            sock.close()

    thread = threading.Thread(target=run, name="edge-dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60  # bounds a hang only
    while not started.wait(0.05) and not server.started and time.monotonic() < deadline:
        pass
    if not server.started:
        registry.close()
        raise ConfigError(f"--ui {address}: the dashboard did not start (see the log)")
    ui = UiServer(host, int(sock.getsockname()[1]), server, thread, registry, app)
    log.info("dashboard (read-only) on %s%s", ui.url, " (token required)" if token else "")
    return ui
