"""The dashboard's ASGI app (Starlette + Jinja2): GET pages and JSON, nothing else.

    /                 fleet: devices, state, battery, power, energy today vs budget (?q= &state= &sort= &desc=1)
    /device/<id>      one device: rounds joined, refusals with reasons, energy per round
    /rounds           jobs and rounds: selected / reporting / dropped / screened, accuracy, bytes, energy
    /models           versions with lineage, sizes, patch sizes, sha256
    /api/<page>.json  the same data as JSON
    /static/...       the page's CSS and JS; /static/plotly.min.js from the installed plotly package

Read-only by construction: only GET/HEAD routes exist (anything else is 405), and the
registry connection is opened `mode=ro`. The pages refresh themselves by fetching their
own `?partial=1` fragment every few seconds (dashboard.js), so no inline script is needed
and the Content-Security-Policy forbids it. A token, when configured, is required on
every request (Bearer, or Basic with the token as password so that a phone's browser can
prompt for it); its value never appears in a page.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, select_autoescape
from markupsafe import Markup
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import (
    FileResponse,
    HTMLResponse,
    JSONResponse,
    PlainTextResponse,
    Response,
)
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from ..coordinator.records import NotFound
from ..coordinator.registry import Registry
from ..coordinator.rounds import RoundPolicy
from ..errors import InputError
from . import views

HERE = Path(__file__).resolve().parent
REFRESH_S = 3
SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                               "img-src 'self' data:; connect-src 'self'; font-src 'self' data:; "
                               "base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
}


def plotly_js() -> Path | None:
    """plotly.js as the installed `plotly` wheel ships it (vendored at install time, never fetched)."""
    try:
        import plotly
    except ImportError:
        return None
    path = Path(plotly.__file__).resolve().parent / "package_data" / "plotly.min.js"
    return path if path.is_file() else None


class Guard:
    """Security headers on every response; the token check; GET/HEAD only."""

    def __init__(self, app: ASGIApp, *, token: str | None, bind_host: str = "127.0.0.1") -> None:
        self.app, self.token = app, token
        self.local_names = {"localhost", "127.0.0.1", "::1", bind_host.lower()}

    def host_ok(self, scope: Scope) -> bool:
        """Without a token, only requests addressed to a loopback name: a web page that
        rebinds its own DNS name to 127.0.0.1 cannot read the dashboard through a browser."""
        if self.token is not None:
            return True
        host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").strip().lower()
        name = host[1:].partition("]")[0] if host.startswith("[") else host.rpartition(":")[0] or host
        return name in self.local_names

    def allowed(self, scope: Scope) -> bool:
        client = scope.get("client")
        try:
            loopback = client is not None and ipaddress.ip_address(client[0]).is_loopback
        except ValueError:
            loopback = False
        if self.token is None:
            return loopback  # without a token the UI is bound to loopback: anything else is a surprise
        header = dict(scope.get("headers") or []).get(b"authorization", b"").decode("latin-1")
        scheme, _, value = header.partition(" ")
        given = value.strip()
        if scheme.lower() == "basic":
            try:
                given = base64.b64decode(given, validate=True).decode("utf-8").partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                return False
        elif scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(given.encode(), self.token.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        if not self.host_ok(scope):
            response: Response = PlainTextResponse("421: not a name this dashboard answers to\n", 421)
        elif not self.allowed(scope):
            response = PlainTextResponse("401: a token is required (Authorization: Bearer ...)\n", 401,
                                                   headers={"www-authenticate": 'Basic realm="edge-fleet"'})
        elif scope["method"] not in ("GET", "HEAD"):
            response = PlainTextResponse("405: the dashboard is read-only\n", 405, headers={"allow": "GET, HEAD"})
        else:
            async def with_headers(message: dict[str, Any]) -> None:
                if message["type"] == "http.response.start":
                    headers = [(k, v) for k, v in message.get("headers", []) if k.decode().lower()
                               not in SECURITY_HEADERS]
                    message["headers"] = headers + [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
                await send(message)
            await self.app(scope, receive, with_headers)
            return
        for key, value in SECURITY_HEADERS.items():
            response.headers[key] = value
        await response(scope, receive, send)


def _fmt_time(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else views.DASH


def _is_num(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def _fmt_bytes(n: float | None) -> str:
    if not _is_num(n):
        return views.DASH
    return f"{n / 1e6:.2f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB" if n >= 1e3 else f"{n:.0f} B"


def _fmt_pct(x: float | None) -> str:
    return f"{100 * x:.1f} %" if _is_num(x) else views.DASH


def _fmt_num(x: Any, digits: int = 2) -> str:
    return views.DASH if not _is_num(x) else f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def _json_for_script(value: Any) -> Markup:
    """JSON to embed in <script type="application/json">: no `<`, `>` or `&` to end the element."""
    text = json.dumps(views.as_json(value), allow_nan=False)
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))


def make_app(registry: Registry, *, policy: RoundPolicy | None = None, token: str | None = None,
             clock: Callable[[], float] = time.time, bind_host: str = "127.0.0.1") -> ASGIApp:
    """The app over an open (read-only) registry. `token`: required on every request if set."""
    policy = policy or RoundPolicy()
    env = Environment(loader=FileSystemLoader(HERE / "templates"), autoescape=select_autoescape(["html"]),
                      auto_reload=False)
    env.filters.update(when=_fmt_time, size=_fmt_bytes, pct=_fmt_pct, num=_fmt_num)
    env.globals.update(dash=views.DASH, refresh_s=REFRESH_S)
    lock = threading.Lock()  # one registry connection: one reader at a time

    # the page handlers are plain functions: Starlette runs them in its thread pool, so a long
    # render never stalls the event loop (one registry connection: `read` takes turns)
    def render(request: Request, name: str, *, started: float | None = None, **context: Any) -> HTMLResponse:
        """The page; Server-Timing covers the template, or everything since `started`."""
        partial = request.query_params.get("partial") == "1"
        started = time.perf_counter() if started is None else started
        html = env.get_template(name).render(partial=partial, path=request.url.path, **context)
        took = time.perf_counter() - started
        return HTMLResponse(html, headers={"server-timing": f"render;dur={1000 * took:.1f}"})

    def read(fn: Callable[[], Any]) -> Any:
        with lock:
            return fn()

    def fleet_data(request: Request) -> dict[str, Any]:
        p = request.query_params
        sort = p.get("sort", "name") if p.get("sort") in views.SORT_KEYS else "name"
        state = p.get("state", "all") if p.get("state") in views.STATE_FILTERS else "all"
        return read(lambda: views.fleet(registry, policy=policy, now=clock(), q=p.get("q", "")[:64],
                                        state=state, sort=sort, desc=p.get("desc") == "1"))

    def fleet_page(request: Request) -> Response:
        started = time.perf_counter()
        data = fleet_data(request)
        p = request.query_params
        return render(request, "fleet.html", started=started, data=data, q=p.get("q", "")[:64],
                      state=p.get("state", "all"), sort=p.get("sort", "name"), desc=p.get("desc") == "1",
                      sort_keys=views.SORT_KEYS, state_filters=views.STATE_FILTERS)

    def device_page(request: Request) -> Response:
        dev_id = request.path_params["device_id"]
        try:
            data = read(lambda: views.device(registry, dev_id, policy=policy, now=clock()))
        except NotFound:
            return PlainTextResponse("404: no such device\n", 404)
        except InputError as exc:  # an id the registry refuses: say so (other errors are 500s, logged)
            return PlainTextResponse(f"400: {str(exc)[:200]}\n", 400)
        return render(request, "device.html", d=data, chart=_json_for_script(data["history"]),
                      samples=_json_for_script(data["samples"]))

    def rounds_page(request: Request) -> Response:
        data = read(lambda: views.rounds(registry))
        return render(request, "rounds.html", data=data, chart=_json_for_script(data["series"]))

    def models_page(request: Request) -> Response:
        return render(request, "models.html", models=read(lambda: views.models(registry)))

    def api(request: Request) -> Response:
        page = request.path_params["page"]
        if page == "fleet":
            data: Any = fleet_data(request)
        elif page == "rounds":
            data = read(lambda: views.rounds(registry))
        elif page == "models":
            data = read(lambda: views.models(registry))
        else:
            return PlainTextResponse("404\n", 404)
        return JSONResponse(views.as_json(data))

    def plotly(request: Request) -> Response:
        path = plotly_js()
        if path is None:
            return PlainTextResponse("404: the plotly package is not installed (pip install plotly)\n", 404)
        return FileResponse(path, media_type="text/javascript")

    routes = [
        Route("/", fleet_page, methods=["GET", "HEAD"]),
        Route("/device/{device_id}", device_page, methods=["GET", "HEAD"]),
        Route("/rounds", rounds_page, methods=["GET", "HEAD"]),
        Route("/models", models_page, methods=["GET", "HEAD"]),
        Route("/api/{page}.json", api, methods=["GET", "HEAD"]),
        Route("/static/plotly.min.js", plotly, methods=["GET", "HEAD"]),
        Mount("/static", app=StaticFiles(directory=HERE / "static"), name="static"),
    ]
    app = Starlette(routes=routes)
    return Guard(app, token=token, bind_host=bind_host)
