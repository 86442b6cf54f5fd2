"""Error kinds and the documented process exit codes.

Two kinds of failure (DESIGN.md): transient ones are retried with full-jitter backoff,
fatal ones are reported. Exit codes follow sysexits(3) so that systemd's
`RestartPreventExitStatus=` can stop a restart loop on a configuration error.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

EXIT_OK = 0
EXIT_FAILURE = 1  # a runtime failure; systemd may restart
EXIT_USAGE = 64  # bad command line (EX_USAGE)
EXIT_DATAERR = 65  # bad input data: a corrupt bundle, data set or update (EX_DATAERR)
EXIT_UNAVAILABLE = 69  # a required service or engine is unavailable (EX_UNAVAILABLE)
EXIT_NOPERM = 77  # needs root, e.g. install-service (EX_NOPERM)
EXIT_CONFIG = 78  # bad configuration or board profile (EX_CONFIG): do not restart

EXIT_CODES = {
    EXIT_OK: "success",
    EXIT_FAILURE: "runtime failure",
    EXIT_USAGE: "bad command line",
    EXIT_DATAERR: "bad input data",
    EXIT_UNAVAILABLE: "required service or engine unavailable",
    EXIT_NOPERM: "permission denied (needs root)",
    EXIT_CONFIG: "configuration error (not restarted by systemd)",
}


class EdgeAgentError(Exception):
    """Base class: an error the user should see as one clear line, not a traceback."""

    exit_code = EXIT_FAILURE


class ConfigError(EdgeAgentError):
    """Bad configuration or board profile."""

    exit_code = EXIT_CONFIG


class InputError(EdgeAgentError):
    """Untrusted input (file, message, sensor value) failed validation."""

    exit_code = EXIT_DATAERR


class TransientError(EdgeAgentError):
    """Worth retrying later (broker down, sensor busy, battery low)."""


class FatalError(EdgeAgentError):
    """Not worth retrying; reported to the coordinator."""


def run_command(prog: str, command: Callable[[], int | None]) -> int:
    """Run a CLI command: an EdgeAgentError becomes one line on stderr and its exit code
    (never a traceback for a user's mistake); Ctrl-C exits 130 like a shell."""
    try:
        return int(command() or 0)
    except EdgeAgentError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130
