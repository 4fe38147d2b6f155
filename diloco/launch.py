"""What every process entry point shares: reading the job config and token, CPU pinning."""

from __future__ import annotations

import argparse
import os
import sys

from diloco.contract import MIN_TOKEN_CHARS, TOKEN_ENV, Exit
from diloco.spec import DecoupledDiLoCoJob, SpecError, load_job


def load_config(path: str) -> DecoupledDiLoCoJob:
    """Load the manifest or exit 2 with one line per problem (nothing is started)."""
    try:
        return load_job(path)
    except SpecError as exc:
        for line in exc.problems:
            print(line, file=sys.stderr)
        raise SystemExit(Exit.CONFIG) from None


def read_token(args: argparse.Namespace) -> str:
    """The per-job token from --token-file or $DILOCO_TOKEN; refusing to run without one."""
    token = ""
    if getattr(args, "token_file", None):
        try:
            with open(args.token_file, encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError as exc:
            raise SystemExit(f"--token-file {args.token_file}: {exc.strerror}") from None
    else:
        token = os.environ.get(TOKEN_ENV, "").strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise SystemExit(
            f"a job token of at least {MIN_TOKEN_CHARS} characters is required: pass --token-file or set ${TOKEN_ENV}"
        )
    return token


def pin_cpus(spec: str | None) -> None:
    """Pin this process to CPUs (`"0"`, `"0,1"`) before JAX starts: XLA's thread flags do nothing
    on small CPU hosts, and pinned learners share cores fairly (docs/DEVELOPMENT.md, "Several processes on few cores")."""
    if not spec:
        return
    try:
        cpus = {int(c) for c in spec.split(",") if c.strip()}
        os.sched_setaffinity(0, cpus)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"--cpus {spec!r}: {exc}") from None


def read_pem(path: str | None, flag: str) -> bytes | None:
    """A PEM file named by a flag, or None; a missing or non-PEM file is a clear error."""
    if not path:
        return None
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise SystemExit(f"{flag} {path}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise SystemExit(f"{flag} {path}: not a PEM file")
    return data
