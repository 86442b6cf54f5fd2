"""Topic layout: names of one fleet's topics, and what a received topic means."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import InputError
from .schema import ID_RE, SECAGG_DOWN, SECAGG_UP, Kind, validate_id

DEFAULT_PREFIX = "edgeft/v1"
# Which kinds a topic channel carries and who must have signed them ("self": key in body).
_DEVICE_CHANNELS: dict[str, tuple[tuple[Kind, ...], str]] = {
    "hello": ((Kind.HELLO,), "self"), "state": ((Kind.STATE,), "device"),
    "cmd": ((Kind.CMD,), "coordinator"), "ack": ((Kind.ACK, Kind.REFUSAL), "coordinator"),
    "progress": ((Kind.PROGRESS, Kind.REFUSAL), "device"), "update": ((Kind.UPDATE_CHUNK,), "device"),
    # secure aggregation: a device's advert, shares, masked input and reveal; the coordinator's
    # roster, inbox and unmask request to it (schema.SECAGG_UP / SECAGG_DOWN)
    "secagg": (SECAGG_UP, "device"), "secagg_cmd": (SECAGG_DOWN, "coordinator"),
}


PATCH_SUFFIX = ".head"  # a version's head patch is published as version "<version>.head"


def patch_version(version: str) -> str:
    """The publication id of `version`'s head patch (int8.bundle_patch)."""
    return f"{version}{PATCH_SUFFIX}"


@dataclass(frozen=True)
class Route:
    """What a topic means: the kinds it carries, who signs them, and its ids."""

    topic: str
    address: str  # "<fleet>/<topic below the fleet>": what signatures bind to
    channel: str
    kinds: tuple[Kind, ...]
    signer: str  # "device" | "coordinator" | "self"
    device: str | None = None
    model: str | None = None
    version: str | None = None
    index: int | None = None
    key: str | None = None  # coordinator/key/<key id>: the old key a rotation is signed by


class Topics:
    """Topic names of one fleet under one prefix."""

    def __init__(self, *, fleet: str, prefix: str = DEFAULT_PREFIX) -> None:
        validate_id(fleet, "fleet")
        parts = prefix.split("/")
        if not prefix or any(not p or "+" in p or "#" in p or "\0" in p for p in parts) or len(prefix) > 128:
            raise InputError(f"topic prefix {prefix!r} must be non-empty '/'-separated segments without wildcards")
        self.fleet, self.prefix = fleet, prefix
        self.root = f"{prefix}/{fleet}"

    def device(self, device_id: str, channel: str) -> str:
        if channel not in _DEVICE_CHANNELS:
            raise ValueError(f"unknown device channel {channel!r}")
        return f"{self.root}/devices/{validate_id(device_id, 'device id')}/{channel}"

    def manifest(self, name: str, version: str) -> str:
        return f"{self.root}/models/{validate_id(name, 'model')}/{validate_id(version, 'version')}/manifest"

    def model_chunk(self, name: str, version: str, index: int) -> str:
        return f"{self.root}/models/{validate_id(name, 'model')}/{validate_id(version, 'version')}/chunk/{index}"

    def model_filter(self, name: str, version: str) -> str:
        return f"{self.root}/models/{validate_id(name, 'model')}/{validate_id(version, 'version')}/#"

    def coordinator_key(self, key_id: str) -> str:
        """Where the rotation away from coordinator key `key_id` is published (retained),
        signed by that key: a device trusting it subscribes here."""
        return f"{self.root}/coordinator/key/{validate_id(key_id, 'key id')}"

    def device_subscriptions(self, device_id: str) -> list[str]:
        return [self.device(device_id, "cmd"), self.device(device_id, "ack"), self.device(device_id, "secagg_cmd")]

    def coordinator_subscriptions(self) -> list[str]:
        return [f"{self.root}/devices/+/{c}" for c in ("hello", "state", "progress", "update", "secagg")]

    def parse(self, topic: str) -> Route | None:
        if not topic.startswith(self.root + "/"):
            return None
        rel = topic[len(self.root) + 1 :]
        parts, address = rel.split("/"), f"{self.fleet}/{rel}"
        if len(parts) == 3 and parts[0] == "devices" and ID_RE.fullmatch(parts[1]) and parts[2] in _DEVICE_CHANNELS:
            kinds, signer = _DEVICE_CHANNELS[parts[2]]
            return Route(topic, address, parts[2], kinds, signer, device=parts[1])
        if len(parts) >= 4 and parts[0] == "models" and ID_RE.fullmatch(parts[1]) and ID_RE.fullmatch(parts[2]):
            if len(parts) == 4 and parts[3] == "manifest":
                return Route(topic, address, "manifest", (Kind.MANIFEST,), "coordinator", model=parts[1],
                             version=parts[2])
            if len(parts) == 5 and parts[3] == "chunk" and re.fullmatch(r"0|[1-9][0-9]{0,4}", parts[4]):
                return Route(topic, address, "chunk", (Kind.MODEL_CHUNK,), "coordinator", model=parts[1],
                             version=parts[2], index=int(parts[4]))
        if len(parts) == 3 and parts[:2] == ["coordinator", "key"] and ID_RE.fullmatch(parts[2]):
            return Route(topic, address, "key", (Kind.KEY_ROTATION,), "coordinator", key=parts[2])
        return None
