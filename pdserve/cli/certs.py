"""``pdserve certs DIR``: a private CA and a certificate per process for mutual TLS inside a
deployment (docker compose, Kubernetes), one directory per name in cert-manager's Secret
layout (``ca.crt``, ``tls.crt``, ``tls.key``): ``pdserve.rpc.ca``, docs/deploy.md."""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

DEFAULT_NAMES = "gateway,prefill,decode"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "directory", type=Path, help="where to write <name>/{ca.crt,tls.crt,tls.key}"
    )
    parser.add_argument(
        "--names",
        default=DEFAULT_NAMES,
        help=f"comma-separated process names, one certificate each (default {DEFAULT_NAMES}: "
        "the roles of deploy/compose and deploy/k8s)",
    )
    parser.add_argument("--days", type=int, default=365, help="validity of the CA and certificates")
    parser.add_argument(
        "--force", action="store_true", help="replace certificates already in the directory"
    )


def run(args: argparse.Namespace) -> int:
    from pdserve.rpc.ca import write_set
    from pdserve.rpc.tls import CERT_FILE

    names = [n.strip() for n in args.names.split(",") if n.strip()]
    if not names or args.days < 1:
        print("pdserve certs: give at least one name and --days >= 1", file=sys.stderr)
        return 2
    there = [n for n in names if (args.directory / n / CERT_FILE).exists()]
    if there and not args.force:
        print(f"pdserve certs: {args.directory} already holds certificates for {', '.join(there)} "
              "(--force replaces them, with a new CA for all)", file=sys.stderr)  # fmt: skip
        return 1
    try:
        dirs = write_set(args.directory, names, datetime.timedelta(days=args.days))
    except ValueError as exc:
        print(f"pdserve certs: {exc}", file=sys.stderr)
        return 2
    for name, path in dirs.items():
        print(f"{name}: {path}")
    return 0
