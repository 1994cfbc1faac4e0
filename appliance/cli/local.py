"""`appliance keys`, `config`, `tls`: local files, made or checked offline."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from appliance import config, keys
from appliance.cli.access import add_key_actions
from appliance.cli.options import add_config, command
from appliance.config import QuicConfig
from appliance.config.text import to_toml
from appliance.durable import make_directories
from appliance.errors import ApplianceError
from appliance.tls import init_self_signed


def cmd_keys(args: argparse.Namespace) -> int:
    make_directories(args.out.parent)  # 0755, as the trust directory; the key itself is 0600, the public half 0644
    if args.trust_dir is not None:
        make_directories(args.trust_dir)
    try:
        kid = keys.new_key_pair(args.out, args.trust_dir)
    except FileExistsError:
        raise ApplianceError(
            f"{args.out} exists: a new key would replace the one firmware may be signed with; remove it or give another path"
        ) from None
    print(
        f"key {kid}: private {args.out}, public {args.out.with_suffix('.pub')}"
        + (f", trusted in {args.trust_dir}" if args.trust_dir else "")
    )
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    print(to_toml(config.load(args.config)), end="")
    return 0


def cmd_tls(args: argparse.Namespace) -> int:
    if args.cert.exists() and args.key.exists() and not args.force:
        print(f"{args.cert} exists (use --force to replace it)")
        return 0
    fingerprint = init_self_signed(args.cert, args.key, args.name)
    print(f"certificate {args.cert}, key {args.key}, sha256 fingerprint {fingerprint}")
    return 0


def add_parsers(sub: Any) -> None:
    keys_ = command(sub, "keys", "signing keys for firmware bundles and images (new); API keys (add, list, revoke)")
    keys_sub = keys_.add_subparsers(dest="action", required=True, metavar="ACTION")
    new = command(keys_sub, "new", "make an Ed25519 signing key pair")
    new.add_argument("--out", type=Path, required=True, help="private key path; the public key goes next to it as .pub")
    new.add_argument("--trust-dir", type=Path, help="also trust the public key there")
    new.set_defaults(func=cmd_keys)
    add_key_actions(keys_sub)

    cfg = command(sub, "config", "check config files")
    cfg_sub = cfg.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = command(
        cfg_sub,
        "check",
        "load the config strictly and print the merged result as TOML (which loads again to the same config)",
    )
    add_config(check)
    cfg.set_defaults(func=cmd_config)

    tls = command(sub, "tls", "TLS material for the QUIC listener, made offline")
    tls_sub = tls.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = command(tls_sub, "init", "make a self-signed certificate and key for this box")
    init.add_argument("--cert", type=Path, default=QuicConfig().certificate, help="the certificate (PEM) to write")
    init.add_argument("--key", type=Path, default=QuicConfig().private_key, help="the private key (PEM) to write")
    init.add_argument("--name", action="append", default=[], help="extra DNS name or IP address (repeatable)")
    init.add_argument("--force", action="store_true", help="replace an existing certificate and key")
    tls.set_defaults(func=cmd_tls)
