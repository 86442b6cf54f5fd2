"""Giving freed memory back to the OS in the long-running daemons.

A daemon that runs for a year allocates and frees the same kinds of objects every job or
round (messages, records, arrays). CPython returns freed objects to its own pools and
glibc keeps freed heap pages in its arenas, so RSS creeps up through fragmentation even
when nothing leaks. After each unit of work ends (an agent's job, a coordinator's round)
the daemons collect reference cycles and ask glibc to release free pages at the top and
inside its arenas (`malloc_trim(0)`); elsewhere (musl, macOS) only the collection runs.

A fine-tuning job calls it at its phase ends too (the oracle's chunks, the parsed graphs),
where a full collection walked every object the interpreter tracks -- the imports' ~40,000
of them, none garbage -- for ~20 ms a call, ~0.08 CPU-s of a textures first job of ~2.3.
Inside `new_objects_only()` a collection walks what was made since the block began
(gc.freeze): what existed before it is not collected in cycles until the block ends.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import gc
import threading
from collections.abc import Iterator
from typing import Any

_frozen = 0  # new_objects_only() blocks open in this process
_frozen_lock = threading.Lock()


@functools.cache
def _malloc_trim() -> Any:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to trim
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Collect cycles and trim the C heap; True if the heap was trimmed (glibc)."""
    gc.collect()
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True


@contextlib.contextmanager
def new_objects_only() -> Iterator[None]:
    """Cycle collections inside the block leave out the objects that existed when the first
    such block began (nested or concurrent blocks share one freeze; the last to end lifts it).
    For one unit of work in a process whose earlier objects live on (a job's imports): what
    they drop into cycles meanwhile is collected after the block."""
    global _frozen
    with _frozen_lock:
        if _frozen == 0:
            gc.freeze()
        _frozen += 1
    try:
        yield
    finally:
        with _frozen_lock:
            _frozen -= 1
            if _frozen == 0:
                gc.unfreeze()
