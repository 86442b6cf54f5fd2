"""What both sides read the same way, kept on the protocol floor so the coordinator never
imports the agent: a device's state facts, and a broker address.

State facts are a flat map (numbers, booleans, short strings) in the retained `state`
message's `info`; older agents sent only a `detail` text of `k=v` pairs (at most 256
characters, what `mosquitto_sub` shows), which `facts_from_state` reads back too.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from .schema import clean_flat

MAX_DETAIL = 256


def facts_from_state(body: Mapping[str, Any]) -> dict[str, Any]:
    """The facts of a state body: its `info`, else parsed back from `detail` (numbers and
    booleans restored). Untrusted input: junk pairs, and values the protocol's schema of
    flat maps refuses (battery_pct=18446744073709551616), are skipped."""
    if isinstance(body.get("info"), dict):
        return {"status": body.get("status"), **body["info"]}
    out: dict[str, Any] = {"status": body.get("status")}
    for pair in str(body.get("detail", ""))[:MAX_DETAIL].split():
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            continue
        value: Any = raw
        if raw in ("true", "false"):
            value = raw == "true"
        else:
            try:
                value = int(raw)
            except ValueError:
                try:
                    value = float(raw)
                except ValueError:
                    value = raw
        out[key] = value
    return clean_flat(out)


def parse_broker(text: str) -> tuple[str, int | None]:
    """HOST, HOST:PORT or [IPv6]:PORT -> (host, port or None); an argparse `type=` for both
    command lines (argparse.ArgumentTypeError names what is wrong)."""
    host, port = text.strip(), None
    if host.startswith("["):
        inner, _, rest = host[1:].partition("]")
        host, port_text = inner, rest[1:] if rest.startswith(":") else ""
    elif host.count(":") == 1:
        host, port_text = host.split(":")
    else:
        port_text = ""
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            raise argparse.ArgumentTypeError(f"bad port in {text!r}")
        port = int(port_text)
    if not host or len(host) > 253 or any(c in host for c in " /#+\"'"):
        raise argparse.ArgumentTypeError(f"bad broker host in {text!r}")
    return host, port
