"""The `appliance` command: run the daemon, call it, build and check firmware, keys, config, bench."""

from __future__ import annotations

import signal
import sys

if sys.argv[1:2] == ["run"]:  # SIGHUP held from here until the daemon can act on it (appliance/signals.py)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})

import argparse  # noqa: E402 - after the signal is held: these imports take a second on a slow box
import os  # noqa: E402
import select  # noqa: E402
from importlib.metadata import PackageNotFoundError, version  # noqa: E402

from appliance import exitcodes  # noqa: E402
from appliance.cli import access, box, call, firmware, local, run  # noqa: E402
from appliance.cli.options import EmptyAnswer, HelpFormatter  # noqa: E402
from appliance.client import CertificateRejected, ClientError, NoAnswer, ServerError, SocketUnreachable  # noqa: E402
from appliance.errors import ApplianceError  # noqa: E402


def _version() -> str:
    try:
        return version("appliance")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {_version()}",
        help="print the installed package's version and exit",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run.add_run(sub)
    call.add_parsers(sub)  # call, status
    firmware.add_parsers(sub)
    local.add_parsers(sub)  # keys, config, tls
    access.add_parsers(sub)  # room
    box.add_parsers(sub)  # image, flash, update, recover
    run.add_bench(sub)
    return p


def _error(message: str, code: int) -> int:
    """The one line on stderr that every failure gets (no traceback), and its exit code."""
    print(f"appliance: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def _stdout_closed() -> bool:
    """Whether stdout's reader has gone (a pipe or socket polls as an error or hang-up then)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):
        return True


def _stdout_gone() -> int:
    """stdout was closed early (`appliance call metrics | head -1`): say so once, exit 141 as SIGPIPE would."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere, not into a second error at exit
    os.close(devnull)
    return _error("stdout was closed before all output was written (broken pipe)", exitcodes.BROKEN_PIPE)


def _client_failure(exc: ClientError, args: argparse.Namespace) -> tuple[str, int]:
    """A client error as its line and exit code: the daemon answered with an error (1), or it could not
    be reached (4), with what to do about it."""
    if isinstance(exc, ServerError):
        return f"the daemon answered {exc}", exitcodes.DAEMON_ERROR
    message = str(exc)
    if isinstance(exc, SocketUnreachable) and exc.starting:
        return message, exitcodes.DAEMON_ERROR if getattr(args, "what", "") == "health" else exitcodes.UNREACHABLE
    if isinstance(exc, SocketUnreachable):
        message += "; point at the daemon's socket with --socket PATH or APPLIANCE_SOCKET=PATH"
    elif isinstance(exc, CertificateRejected):
        message += (
            "; give a client certificate it trusts with --cert FILE --key FILE"
            if exc.by_server
            else "; pass the server's certificate (or its CA) with --cafile FILE"
        )
    elif isinstance(exc, NoAnswer) and getattr(args, "quic", None):
        message += "; --timeout SECONDS waits longer"
    return message, exitcodes.UNREACHABLE


def main(argv: list[str] | None = None) -> int:
    """Exit codes (appliance/exitcodes.py; docs/api.md, "Calling the daemon"): 0 ok, 1 the daemon answered with an
    error, 2 usage or local input, 3 the daemon could not start, 4 the daemon could not be reached,
    141 stdout closed; each failure is one line on stderr."""
    command_line = parser()
    args, extra = command_line.parse_known_args(argv)
    if extra and isinstance(getattr(args, "args", None), list) and not any(e.startswith("-") for e in extra):
        args.args += extra  # positionals after options (`call translate --to pt "TEXT"`): argparse leaves them over
    elif extra:
        command_line.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed stdout shows here, not as a traceback at exit
        return code
    except BrokenPipeError as exc:
        if _stdout_closed():
            return _stdout_gone()
        return _error(str(exc), exitcodes.USAGE)
    except EmptyAnswer as exc:
        return _error(str(exc), exitcodes.DAEMON_ERROR)
    except ApplianceError as exc:
        return _error(str(exc), exitcodes.USAGE)
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED
    except ClientError as exc:
        return _error(*_client_failure(exc, args))
    except OSError as exc:  # a local file or device: not the daemon's doing
        return _error(str(exc), exitcodes.USAGE)
