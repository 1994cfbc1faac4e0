"""`appliance keys add/list/revoke` (the API key file, offline) and `appliance room open` (a room's PIN,
from the running daemon over its Unix socket)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from appliance import config
from appliance.api.access import keys as key_file
from appliance.cli.options import CONFIG_HELP, command, default_socket
from appliance.client import Client
from appliance.client.http import Call, checked


def _key_file(args: argparse.Namespace) -> Path:
    return args.file if args.file is not None else config.load(args.config).access.keys


def cmd_add(args: argparse.Namespace) -> int:
    routes = tuple(r.strip() for r in args.routes.split(",") if r.strip()) or key_file.ALL_ROUTES
    share = key_file.Share(args.requests_per_minute, args.sessions, args.audio_seconds_per_hour)
    path = _key_file(args)
    secret = key_file.add(path, args.name, routes, share)
    print(f"key {args.name} added to {path}; its secret, shown only now:\n{secret}")
    print("the daemon takes it at its next reload (systemctl reload appliance, or SIGHUP)")
    return 0


def cmd_list(args: argparse.Namespace) -> int:
    path = _key_file(args)
    keys = key_file.load(path)
    if not keys:
        print(f"{path}: no API keys (QUIC and HTTPS are open to the LAN)")
    for k in keys:
        s = k.share
        print(
            f"{k.name}: routes {','.join(k.routes)}; {s.requests_per_minute} requests/min, {s.sessions} sessions, "
            f"{s.audio_seconds_per_hour} audio s/hour; created {k.created}"
        )
    return 0


def cmd_revoke(args: argparse.Namespace) -> int:
    path = _key_file(args)
    key_file.revoke(path, args.name)
    print(f"key {args.name} revoked in {path}; the daemon drops it (and stops its sessions) at its next reload")
    return 0


def cmd_room(args: argparse.Namespace) -> int:
    doc: dict[str, Any] = {"minutes": args.minutes, **({"model": args.model} if args.model else {})}
    with Client(args.socket) as client:
        room = checked(client.send(Call("POST", "/v1/rooms", json.dumps(doc).encode()))).json()
    print(
        f"room PIN {room['pin']} (link https://BOX:8443{room['link']}), for {room['model']}, until {room['expires_at']}"
    )
    return 0


def add_key_actions(keys_sub: Any) -> None:
    """add, list, revoke: beside `keys new` (signing keys), the API keys LAN clients send."""
    add = command(keys_sub, "add", "add an API key for LAN clients; its secret is printed once")
    add.add_argument("name", help="the key's name (letters, digits, '.', '_', '-')")
    add.add_argument("--routes", default="*", help="route names it may use, comma-separated (as /metrics names them)")
    share = key_file.Share()
    add.add_argument(
        "--requests-per-minute", type=int, default=share.requests_per_minute, help="its requests a minute (0: no bound)"
    )
    add.add_argument(
        "--sessions", type=int, default=share.sessions, help="its WebSocket sessions at once (0: no bound)"
    )
    add.add_argument(
        "--audio-seconds-per-hour",
        type=int,
        default=share.audio_seconds_per_hour,
        help="audio its Realtime sessions may send in any hour (0: no bound)",
    )
    add.set_defaults(func=cmd_add)
    listing = command(keys_sub, "list", "list the API keys (names and shares; secrets are never stored)")
    listing.set_defaults(func=cmd_list)
    revoke = command(keys_sub, "revoke", "remove an API key")
    revoke.add_argument("name", help="the key's name, as `appliance keys list` prints it")
    revoke.set_defaults(func=cmd_revoke)
    for p in (add, listing, revoke):
        p.add_argument("--file", type=Path, help="the API key file (default: access.keys of the config)")
        p.add_argument("--config", type=Path, action="append", help=CONFIG_HELP)


def add_parsers(sub: Any) -> None:
    room = command(sub, "room", "rooms for the box's page: a short-lived PIN instead of an API key")
    room_sub = room.add_subparsers(dest="action", required=True, metavar="ACTION")
    opened = command(room_sub, "open", "open a room: its PIN and link, for the page, until it expires")
    opened.add_argument("--minutes", type=float, default=60.0, help="how long the room lasts")
    opened.add_argument("--model", help="the speech pipeline its sessions use (default: the first)")
    opened.add_argument("--socket", default=default_socket(), help="the daemon's Unix socket")
    opened.set_defaults(func=cmd_room)
