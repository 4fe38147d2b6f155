"""The learner's events: one JSON object per line on stdout (contract.Event), which the local
runner and the operator's logs read; and the container's termination message."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from typing import Any

from diloco.contract import TERMINATION_LOG_ENV

_EMITTING = threading.Lock()
SPEAKS = [True]  # host 0 speaks for a multi-host learner (trainer/hosts.py); the others are silent


def emit(event: str, **fields: Any) -> None:  # one JSON object per line: contract.Event
    """Whole lines only: the loop and the client's threads all emit, and print() writes the
    object and its newline separately, so two threads could run their lines together."""
    if not SPEAKS[0]:
        return
    line = json.dumps({"t": time.time(), "event": event, **fields}) + "\n"
    with _EMITTING:
        sys.stdout.write(line)
        sys.stdout.flush()


def termination_message(text: str) -> None:
    """Write `text` to $DILOCO_TERMINATION_LOG (the container's terminationMessagePath), if set.
    The exit at spec.training.steps writes contract.Finished; bad input mid-run, its line; the start writes
    "", which clears a marker a runtime that kept the file across starts would show after a kill
    (the kubelet gives each container start a fresh, empty file)."""
    path = os.environ.get(TERMINATION_LOG_ENV)
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    except OSError as exc:
        print(f"${TERMINATION_LOG_ENV}={path}: cannot write the termination message: {exc}", file=sys.stderr)
