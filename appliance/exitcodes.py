"""The `appliance` command's exit codes, one scheme for every subcommand (docs/api.md: exit codes).

A module of its own, importing nothing of ours, so the CLI and the daemon share it without a cycle.
`exit_text` says how a child process ended (a protocol worker, a translator).
"""

import signal

OK = 0
DAEMON_ERROR = 1  # the daemon answered with an error (HTTP 4xx/5xx), or `call health` found it not ready
USAGE = 2  # bad arguments or local input: a missing or unreadable file, a bundle, image or config that fails
START_FAILED = 3  # `appliance run`: the daemon could not start (systemd: RestartPreventExitStatus=3)
UNREACHABLE = 4  # could not reach the daemon: no socket, refused, no QUIC answer, certificate rejected, timeout
INTERRUPTED = 130  # Ctrl-C (128 + SIGINT)
BROKEN_PIPE = 141  # stdout was closed before all output was written (128 + SIGPIPE, as a shell reports it)


def exit_text(code: int) -> str:
    """A child's return code as a person reads it: "signal SIGKILL" or "code 1"."""
    if code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"code {code}"
