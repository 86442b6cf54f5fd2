"""Child processes: the daemon never imports MXNet or numpy, its children do.

The contract between the daemon and `python -m edge_agent.agent.child` (child.py):

    child {train|activate} --spec SPEC.json --events-fd N --parent-pid PID

* SPEC.json (written atomically by the daemon) holds every argument; see child.py.
* Events: one JSON object per line on file descriptor N (a pipe the daemon reads without
  blocking), e.g. {"phase": "train", "step": 12, "total_steps": 300, "loss": 0.41, ...} —
  the fields of edge_agent.train.job.Progress — plus {"phase": "error", "detail": ...}
  before a failing exit. Lines that are not JSON objects are ignored.
* The child asks the kernel to SIGTERM it when the daemon dies (PR_SET_PDEATHSIG), so a
  kill -9 of the daemon does not leave an orphan training (and holding the job's lock);
  SIGTERM makes the trainer checkpoint and stop at the next step.
* Results live in the job directory, written before the exit: result.json (written last),
  update.chunks (the update's wire chunks, `pack_chunks`), residual.pending (the
  error-feedback residual to adopt once the update is queued).
* Exit codes: EXIT_TRAINED 0 (result.json says "trained"), EXIT_STOPPED 3 (stopped
  before finishing -- cancelled, battery-low -- or trained no step: result.json says why,
  "failed" with the report's "failure" for the latter), EXIT_BUSY 75 (the
  job's lock is held: try again shortly), EXIT_DATAERR 65 / EXIT_CONFIG 78 (bad data,
  bundle or settings: the job fails); anything else is a crash (respawned, and counted
  against the job's re-entry limit).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..atomic import atomic_write_json, read_checked, read_limited
from ..errors import EXIT_CONFIG, EXIT_DATAERR, InputError

log = logging.getLogger(__name__)

EXIT_TRAINED = 0
EXIT_STOPPED = 3
EXIT_BUSY = 75  # EX_TEMPFAIL
FAIL_CODES = (EXIT_DATAERR, EXIT_CONFIG)
CHILD_MODULE = "edge_agent.agent.child"
SPEC_FILE, RESULT_FILE, UPDATE_FILE, RESIDUAL_FILE = "spec.json", "result.json", "update.chunks", "residual.pending"
SECAGG_DELTA = "secagg.delta"  # a secure job's dense delta (float64, tensors in name order): agent/secure.py
MAX_EVENT_LINE = 64 * 1024
MAX_RESULT_BYTES = 256 * 1024
MAX_UPDATE_FILE = 64 << 20
_CHUNKS_MAGIC = b"EAUL"


def pack_chunks(chunks: Sequence[bytes]) -> bytes:
    """The update's chunk list as one blob (framed again by write_checked on disk)."""
    parts = [_CHUNKS_MAGIC, struct.pack(">I", len(chunks))]
    for chunk in chunks:
        parts += [struct.pack(">I", len(chunk)), bytes(chunk)]
    return b"".join(parts)


def unpack_chunks(blob: bytes) -> list[bytes]:
    """Inverse of pack_chunks; raises InputError on anything inconsistent."""
    if blob[:4] != _CHUNKS_MAGIC or len(blob) < 8:
        raise InputError("update file: bad magic")
    (count,) = struct.unpack_from(">I", blob, 4)
    pos, chunks = 8, []
    for i in range(count):
        if pos + 4 > len(blob):
            raise InputError(f"update file: truncated at chunk {i}")
        (n,) = struct.unpack_from(">I", blob, pos)
        if pos + 4 + n > len(blob):
            raise InputError(f"update file: chunk {i} of {n} bytes runs past the end")
        chunks.append(blob[pos + 4 : pos + 4 + n])
        pos += 4 + n
    if pos != len(blob) or not chunks:
        raise InputError("update file: trailing bytes or no chunks")
    return chunks


def read_result(job_dir: Path) -> dict[str, Any] | None:
    """The child's result.json, None if it has not written one (or it is unreadable)."""
    try:
        obj = json.loads(read_limited(job_dir / RESULT_FILE, MAX_RESULT_BYTES))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, InputError) as exc:
        log.error("%s: unreadable result (%s); the job will run again", job_dir / RESULT_FILE, exc)
        return None
    return obj if isinstance(obj, dict) else None


def read_update(job_dir: Path) -> list[bytes]:
    return unpack_chunks(read_checked(job_dir / UPDATE_FILE, MAX_UPDATE_FILE))


class ChildProcess:
    """One child process and its event pipe. All methods are non-blocking except stop()."""

    def __init__(self, *, command: str, spec: dict[str, Any], job_dir: Path, name: str,
                 python: Sequence[str] | None = None) -> None:
        if command not in ("train", "activate"):
            raise ValueError(f"unknown child command {command!r}")
        self.command, self.spec, self.job_dir, self.name = command, spec, Path(job_dir), name
        # Tests may point `python` at another interpreter line; production uses this one.
        self._python = list(python) if python else [sys.executable, "-m", CHILD_MODULE]
        self._proc: subprocess.Popen[bytes] | None = None
        self._fd: int | None = None
        self._buf = b""
        self.last_error = ""
        self.started_at = 0.0
        self.stop_requested = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    def start(self) -> None:
        spec_path = self.job_dir / SPEC_FILE
        atomic_write_json(spec_path, self.spec)
        r, w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [*self._python, self.command, "--spec", str(spec_path), "--events-fd", str(w),
                 "--parent-pid", str(os.getpid())],
                pass_fds=(w,), stdin=subprocess.DEVNULL, start_new_session=True, close_fds=True,
                env={"PYTHONWARNINGS": "ignore::DeprecationWarning", **os.environ})  # MXNet's flood
        except BaseException:
            os.close(r)
            raise
        finally:
            os.close(w)
        os.set_blocking(r, False)
        self._fd = r
        self.started_at = time.monotonic()
        log.info("%s: started %s child pid %d", self.name, self.command, self._proc.pid)

    def events(self, limit: int = 1000) -> list[dict[str, Any]]:
        """Complete event lines available now (never blocks)."""
        out: list[dict[str, Any]] = []
        while self._fd is not None and len(out) < limit:
            try:
                data = os.read(self._fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                data = b""
            if not data:  # the child closed its end (it exited)
                os.close(self._fd)
                self._fd = None
                break
            self._buf += data
            *lines, self._buf = self._buf.split(b"\n")
            if len(self._buf) > MAX_EVENT_LINE:
                self._buf = b""  # a runaway line: drop it rather than grow without bound
            for line in lines:
                event = self._parse(line)
                if event is not None:
                    out.append(event)
        return out

    def _parse(self, line: bytes) -> dict[str, Any] | None:
        if not line.strip() or len(line) > MAX_EVENT_LINE:
            return None
        try:
            event = json.loads(line)
        except ValueError:
            return None
        if not isinstance(event, dict) or not isinstance(event.get("phase"), str):
            return None
        if event["phase"] == "error":
            self.last_error = str(event.get("detail", ""))[:500]
        return event

    def poll(self) -> int | None:
        """The exit code once the child has exited (and its pipe is drained), else None."""
        if self._proc is None:
            return None
        code = self._proc.poll()
        if code is None or self._fd is not None:
            return None
        return code

    def signal_stop(self) -> None:
        """Ask the child to checkpoint and stop (SIGTERM); see poll() for the outcome."""
        self.stop_requested = True
        if self._proc is not None and self._proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self._proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, wait up to `timeout` for the checkpoint and exit, then SIGKILL."""
        if self._proc is None:
            return None
        self.signal_stop()
        try:
            code = self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("%s: child %d did not stop within %.0f s; killing it", self.name, self._proc.pid, timeout)
            self._proc.kill()
            code = self._proc.wait()
        self.events()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return code

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
