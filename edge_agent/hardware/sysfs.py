"""Reading /proc, /sys, /dev and /etc under a configurable root, never crashing.

Every node is untrusted: it may be missing, unreadable, return EIO (hwmon drivers do when
the I2C bus hiccups), hold binary junk, or be huge. Readers return the value or None and
record what went wrong in a `Problems` list, so the caller reports it instead of failing.
"""

from __future__ import annotations

import errno
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

MAX_NODE_BYTES = 64 * 1024  # sysfs attributes are one page; cpuinfo on 128 cores ~ 200 KiB
MAX_PROC_BYTES = 1024 * 1024
# what read_text removes: control characters but newline and tab, and undecodable bytes (the
# governor reads /proc/stat twice a training step: one C-level scan rather than a loop in Python)
_JUNK = re.compile("[\x00-\x08\x0b-\x1f\ufffd]")


@dataclass
class Problems:
    """What could not be read, and why: `path: reason` lines for the report."""

    items: list[str] = field(default_factory=list)

    def add(self, path: str, reason: str) -> None:
        self.items.append(f"{path}: {reason}")


class SysRoot:
    """A filesystem root (default `/`) that the probe and power sources read under."""

    def __init__(self, root: str | os.PathLike[str] = "/", *, problems: Problems | None = None) -> None:
        self.root = Path(root)
        self.problems = problems if problems is not None else Problems()

    def path(self, rel: str) -> Path:
        return self.root / rel.lstrip("/")

    def exists(self, rel: str) -> bool:
        return self.path(rel).exists()

    def read_bytes(self, rel: str, *, limit: int = MAX_NODE_BYTES, quiet_missing: bool = True) -> bytes | None:
        """Raw bytes of a node, or None (missing nodes are only recorded if not quiet)."""
        p = self.path(rel)
        try:
            with open(p, "rb") as handle:
                data = handle.read(limit + 1)
        except FileNotFoundError:
            if not quiet_missing:
                self.problems.add(rel, "missing")
            return None
        except IsADirectoryError:
            self.problems.add(rel, "is a directory")
            return None
        except PermissionError:
            self.problems.add(rel, "permission denied")
            return None
        except OSError as exc:  # EIO from a flaky sensor, ENODATA, EINVAL, ...
            self.problems.add(rel, f"read error: {errno.errorcode.get(exc.errno or 0, exc.errno)}")
            return None
        if len(data) > limit:
            self.problems.add(rel, f"larger than {limit} bytes; truncated")
            data = data[:limit]
        return data

    def read_text(self, rel: str, *, limit: int = MAX_NODE_BYTES, quiet_missing: bool = True) -> str | None:
        """Node text with NULs (device-tree strings end in one) and junk bytes removed."""
        data = self.read_bytes(rel, limit=limit, quiet_missing=quiet_missing)
        if data is None:
            return None
        text = data.replace(b"\x00", b" ").decode("utf-8", errors="replace")
        if _JUNK.search(text):
            self.problems.add(rel, "non-text bytes removed")
            text = _JUNK.sub("", text)
        return text.strip()

    def read_int(self, rel: str, *, quiet_missing: bool = True) -> int | None:
        text = self.read_text(rel, quiet_missing=quiet_missing)
        if text is None or text == "":
            return None
        try:
            return int(text.split()[0])
        except ValueError:
            self.problems.add(rel, f"not an integer: {text[:40]!r}")
            return None

    def listdir(self, rel: str) -> list[str]:
        """Sorted entries of a directory; [] if missing or unreadable."""
        p = self.path(rel)
        try:
            return sorted(os.listdir(p))
        except FileNotFoundError:
            return []
        except OSError as exc:
            self.problems.add(rel, f"cannot list: {exc.strerror or exc}")
            return []

    def glob(self, pattern: str) -> list[str]:
        """Paths (relative to the root, with a leading /) matching a glob pattern."""
        base = self.root
        try:
            return sorted("/" + str(p.relative_to(base)) for p in base.glob(pattern.lstrip("/")))
        except OSError as exc:
            self.problems.add(pattern, f"cannot glob: {exc}")
            return []
