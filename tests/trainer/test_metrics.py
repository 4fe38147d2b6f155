"""A learner pod is Ready only once it has joined the syncer: /readyz, beside /metrics."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request

from diloco.trainer.metrics import LearnerMetrics


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_readyz_answers_503_until_joined_then_200() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    metrics = LearnerMetrics("us-0", "us", port)
    assert get(port, "/readyz") == (503, "not joined to the syncer yet\n")
    assert 'diloco_learner_joined{learner="us-0",region="us"} 0.0' in get(port, "/metrics")[1]
    metrics.mark_joined()
    assert get(port, "/readyz") == (200, "joined\n")
    assert 'diloco_learner_joined{learner="us-0",region="us"} 1.0' in get(port, "/metrics")[1]
