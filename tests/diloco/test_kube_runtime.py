"""The test-side container runtime (tests/kube/processes.py) keeps the kubelet's termination-message
contract, which operator/status/steps.py relies on: every container start gets a fresh, empty file at its
terminationMessagePath (mapped to a local file: containers are local processes), and the message
read back is the file's last 4096 bytes."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import pytest

from diloco.contract import TERMINATION_LOG, TERMINATION_LOG_ENV
from tests.helpers import wait_for
from tests.kube.processes import MAX_TERMINATION_MESSAGE, ProcessRuntime

pytestmark = pytest.mark.e2e  # starts processes

# Appends to the termination log (so a reused file would show), then waits for SIGTERM if asked.
SCRIPT = """
import os, signal, sys, time
path = os.environ["{env}"]
with open(path, "a") as f:
    f.write(sys.argv[1])
if sys.argv[2] == "wait":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print("waiting", flush=True)
    time.sleep(60)
"""


def pod(uid: str, text: str, then: str = "exit") -> dict[str, Any]:
    container = {"name": "learner", "image": "i", "command": ["python", "-c", SCRIPT.format(env=TERMINATION_LOG_ENV)],
                 "args": [text, then], "terminationMessagePath": TERMINATION_LOG,
                 "env": [{"name": TERMINATION_LOG_ENV, "value": TERMINATION_LOG}]}
    return {"metadata": {"name": "p-0", "uid": uid, "labels": {}}, "spec": {"containers": [container]}}


def test_each_start_has_its_own_termination_message_file(tmp_path: Path) -> None:
    runtime = ProcessRuntime(None, "ns", tmp_path)  # type: ignore[arg-type]  # no Service, ConfigMap or Secret
    try:
        p = pod("u1", "first")
        runtime.start(p)
        assert wait_for(lambda: runtime.exited(p) is not None, timeout=30, what="exit") is not None
        assert runtime.message(p) == "first"
        runtime.start(pod("u1", "second"))  # the kubelet restarts the container: a new, empty file
        assert wait_for(lambda: runtime.exited(p) is not None, timeout=30, what="exit") is not None
        assert runtime.message(p) == "second"  # not "firstsecond"
        long = pod("u1", "x" * 5000 + "END")
        runtime.start(long)
        wait_for(lambda: runtime.exited(long) is not None, timeout=30, what="exit")
        message = runtime.message(long)
        assert len(message) == MAX_TERMINATION_MESSAGE and message.endswith("END")  # the tail, as the kubelet reads
        # A kill (a failed liveness probe's SIGTERM) leaves what the start wrote: here, its own text only.
        killed = pod("u1", "", "wait")
        runtime.start(killed)
        wait_for(lambda: "waiting" in runtime.logs["u1"].read_text(), timeout=30, what="the SIGTERM handler")
        runtime.kill(killed, signal.SIGTERM)
        wait_for(lambda: runtime.exited(killed) is not None, timeout=30, what="exit")
        assert runtime.exited(killed) == 0  # the learner's SIGTERM exit: 0, as at its steps
        assert runtime.message(killed) == ""
    finally:
        runtime.close()
