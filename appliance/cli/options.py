"""What the commands share: the help formatter, one helper per subcommand, common options, output."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from appliance.client import describe_path
from appliance.durable import starting_marker
from appliance.errors import ApplianceError

DEV_SOCKET = Path("run/api.sock")


class EmptyAnswer(ApplianceError):
    """The daemon answered, but with nothing of what was asked (an interpretation with nothing spoken): exit 1."""


INSTALLED_SOCKET = Path("/run/appliance/api.sock")
TRUSTED_KEYS = Path("/etc/appliance/trusted-keys")
TRUSTED_KEYS_HELP = "directory of trusted public keys (*.pub); the signature must verify against one of them"
CONFIG_HELP = (
    "config file (repeatable, merged in order; without it /etc/appliance/appliance.toml, "
    "then /etc/appliance/conf.d/*.toml)"
)


def default_socket() -> str:
    if env := os.environ.get("APPLIANCE_SOCKET"):
        return env
    development = DEV_SOCKET.exists() or starting_marker(DEV_SOCKET).exists()  # `make run` serves there
    return str(DEV_SOCKET if development else INSTALLED_SOCKET)


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions and epilogs as written; "(default: X)" after each option whose default says something
    (not after required options, flags that are off, or options that are simply absent by default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default in (None, False, [], argparse.SUPPRESS):
            return action.help or ""
        return super()._get_help_string(action) or ""


def command(sub: Any, name: str, help: str, description: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand or sub-action: its help line in the parent's list, the same text atop its own --help."""
    return sub.add_parser(name, help=help, description=description or help, formatter_class=HelpFormatter, **kwargs)


def add_trusted_keys(p: argparse.ArgumentParser, default: Path = TRUSTED_KEYS) -> None:
    p.add_argument("--trusted-keys", type=Path, default=default, metavar="DIR", help=TRUSTED_KEYS_HELP)


def add_config(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, action="append", help=CONFIG_HELP)


def add_selftest_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", default=str(INSTALLED_SOCKET), help="the daemon's socket, for the self-test")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds the self-test waits for the daemon")


def print_json(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def tell(line: str) -> None:
    """A line of a long job on stdout, at once (the journal shows it before the restart or reboot it announces)."""
    print(line, flush=True)


def read_input(path: str, what: str = "", size: int = -1) -> bytes:
    """A file argument's bytes; ApplianceError (exit 2) naming the file and why it cannot be read."""
    name = f"{what} {path}" if what else path
    try:
        with open(path, "rb") as file:
            return file.read(size)
    except IsADirectoryError:
        raise ApplianceError(f"cannot read {name}: it is a directory, not a file") from None
    except FileNotFoundError:
        raise ApplianceError(f"cannot read {name}: {describe_path(path)}") from None
    except OSError as exc:
        raise ApplianceError(f"cannot read {name}: {(exc.strerror or str(exc)).lower()}") from None
