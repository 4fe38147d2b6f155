"""Loaded by every pod process of tests/kube/processes.py (this folder is on its PYTHONPATH): a
container's host name is its pod's, so `socket.gethostname()` answers the $HOSTNAME the runtime
sets to the pod's name, as a container runtime sets it (the syncer names its lease holder, and a
sharded one its shard, by it). The local processes otherwise all share this machine's name."""

import os
import socket

_POD = os.environ.get("HOSTNAME", "")


def _pod_name() -> str:
    return _POD


if _POD:
    socket.gethostname = _pod_name
