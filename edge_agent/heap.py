"""Giving freed memory back to the OS in the long-running daemons.

A daemon that runs for a year allocates and frees the same kinds of objects every job or
round (messages, records, arrays). CPython returns freed objects to its own pools and
glibc keeps freed heap pages in its arenas, so RSS creeps up through fragmentation even
when nothing leaks. After each unit of work ends (an agent's job, a coordinator's round)
the daemons collect reference cycles and ask glibc to release free pages at the top and
inside its arenas (`malloc_trim(0)`); elsewhere (musl, macOS) only the collection runs.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from typing import Any


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
