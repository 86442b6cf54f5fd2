"""Error kinds and the documented process exit codes.

Two kinds of failure (DESIGN.md): transient ones are retried with full-jitter backoff,
fatal ones are reported. Exit codes follow sysexits(3) so that systemd's
`RestartPreventExitStatus=` can stop a restart loop on a configuration error.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import NoReturn

EXIT_OK = 0
EXIT_FAILURE = 1  # a runtime failure; systemd may restart
EXIT_USAGE = 64  # bad command line (EX_USAGE)
EXIT_DATAERR = 65  # bad input data: a corrupt bundle, data set or update (EX_DATAERR)
EXIT_UNAVAILABLE = 69  # a required service or engine is unavailable (EX_UNAVAILABLE)
# nothing was done, nothing is wrong with the input: try again later (EX_TEMPFAIL), e.g. a
# fine-tune whose budget, deadline or battery stopped it before its first training step
EXIT_TEMPFAIL = 75
EXIT_NOPERM = 77  # needs root, e.g. install-service (EX_NOPERM)
EXIT_CONFIG = 78  # bad configuration or board profile (EX_CONFIG): do not restart
EXIT_INTERRUPTED = 130  # Ctrl-C, like a shell (128 + SIGINT)
# stdout was closed early (`| head`): what a C tool killed by SIGPIPE reports (128 + 13), so
# `set -o pipefail` scripts see the same as for `yes | head`; nothing is printed.
EXIT_BROKEN_PIPE = 141

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_FAILURE: "runtime failure",
    EXIT_USAGE: "bad command line",
    EXIT_DATAERR: "bad input data",
    EXIT_UNAVAILABLE: "required service or engine unavailable",
    EXIT_TEMPFAIL: "temporary failure, try again later (a fine-tune that trained no step)",
    EXIT_NOPERM: "permission denied (needs root)",
    EXIT_CONFIG: "configuration error (not restarted by systemd)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
    EXIT_BROKEN_PIPE: "output pipe closed early (e.g. `| head`); nothing printed",
}


class EdgeAgentError(Exception):
    """Base class: an error the user should see as one clear line, not a traceback."""

    exit_code = EXIT_FAILURE


class ConfigError(EdgeAgentError):
    """Bad configuration or board profile."""

    exit_code = EXIT_CONFIG


class UsageError(EdgeAgentError):
    """A bad command line: a flag's value, or flags that do not go together."""

    exit_code = EXIT_USAGE


class InputError(EdgeAgentError):
    """Untrusted input (file, message, sensor value) failed validation."""

    exit_code = EXIT_DATAERR


class TransientError(EdgeAgentError):
    """Worth retrying later (broker down, sensor busy, battery low)."""


class FatalError(EdgeAgentError):
    """Not worth retrying; reported to the coordinator."""


class CliParser(argparse.ArgumentParser):
    """argparse with the documented exit code: a usage error is one line on stderr and 64
    (argparse's own is usage text and 2). Subcommand parsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())
        self.exit(EXIT_USAGE, f"{self.prog}: error: {line} (see {self.prog} --help)\n")


def one_line(exc: BaseException) -> str:
    """An exception as one log line: its type, message and the innermost frame it came from
    (file:line in function). For failures on untrusted input, where a traceback per message
    would let a sender flood the log; the full traceback goes to debug level."""
    where = ""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is not None:
        code = tb.tb_frame.f_code
        where = f" (at {os.path.basename(code.co_filename)}:{tb.tb_lineno} in {code.co_name})"
    return f"{type(exc).__name__}: {str(exc)[:300]}{where}"


def _silence_stdout() -> None:
    """The reader went away: point stdout at /dev/null so the interpreter's final flush
    cannot raise again (the recipe in Python's signal module documentation)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no real stdout (tests capture it): nothing to flush
        pass


def run_command(prog: str, command: Callable[[], int | None]) -> int:
    """Run a CLI command: an EdgeAgentError becomes one line on stderr and its exit code
    (never a traceback for a user's mistake); Ctrl-C exits 130 like a shell; a closed output
    pipe exits 141 silently; an OS error on a path (unreadable file, full disk) is one line
    and exit 1 (its traceback is logged at debug level, `-v`)."""
    try:
        code = int(command() or 0)
        sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
        return code
    except BrokenPipeError:
        _silence_stdout()
        return EXIT_BROKEN_PIPE
    except EdgeAgentError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except OSError as exc:
        logging.getLogger("edge_agent").debug("%s failed", prog, exc_info=True)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"{prog}: error: {where}{exc.strerror or exc}", file=sys.stderr)
        return EXIT_FAILURE
