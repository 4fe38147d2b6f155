"""Prometheus metrics of one learner (names per Prometheus conventions, bounded labels)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

STEP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class LearnerMetrics:
    def __init__(self, learner: str, region: str, port: int | None):
        r = self.registry = CollectorRegistry()
        names, values = ["learner", "region"], [learner, region]  # bounded: one series per learner

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r).labels(*values)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=r).labels(*values)

        self.steps = counter("diloco_learner_steps_total", "Inner steps")
        self.tokens = counter("diloco_learner_tokens_total", "Training tokens consumed")
        self.sent = counter("diloco_learner_sent_bytes_total", "Bytes of outer gradients sent")
        self.received = counter("diloco_learner_received_bytes_total", "Bytes of global state received")
        self.step_seconds = Histogram("diloco_learner_step_seconds", "Wall time of one inner step", names,
                                      registry=r, buckets=STEP_BUCKETS).labels(*values)
        self.loss = gauge("diloco_learner_loss", "Training loss (nats per byte)")
        self.eval_loss = gauge("diloco_learner_eval_loss", "Held-out loss (nats per byte)")
        # Goodput in the spirit of ml-goodput-measurement: acknowledged training time, and the
        # badput this process can see itself (lost work is only known to whoever saw it die).
        self.productive_seconds = counter("diloco_learner_productive_seconds_total",
                                          "Training time whose outer gradients the syncer accepted")
        self.badput_seconds = Counter("diloco_learner_badput_seconds_total", "Time not spent on acknowledged training",
                                      names + ["reason"], registry=r)
        self.joined = gauge("diloco_learner_joined", "1 once this learner has joined the syncer")
        # The devices idle while the loop works between two steps (adopting, bookkeeping, eval);
        # over rate(diloco_learner_step_seconds_sum) it is the share of a step spent waiting on the host.
        self.host_wait_seconds = counter("diloco_learner_host_wait_seconds_total",
                                         "Time between the end of one inner step and the start of the next")
        self._labels = values
        self._totals: dict[Counter, float] = {}  # what each counter fed from a total has reached
        self._joined = False
        if port is not None:
            serve(port, r, lambda: self._joined)

    def mark_joined(self) -> None:
        """From now on /readyz answers 200: the pod is Ready only once it trains with the job."""
        self._joined = True
        self.joined.set(1)

    def step(self, seconds: float, tokens: int, loss: float) -> None:
        self.steps.inc()
        self.tokens.inc(tokens)
        self.step_seconds.observe(seconds)
        self.loss.set(loss)

    def _advance(self, counter: Counter, total: float) -> None:
        """A running total kept elsewhere (the client, the loop): its counter advances by the
        difference, never back."""
        seen = self._totals.get(counter, 0.0)
        counter.inc(max(0.0, total - seen))
        self._totals[counter] = max(seen, total)

    def network(self, sent: int, received: int) -> None:
        self._advance(self.sent, sent)
        self._advance(self.received, received)

    def productive(self, acked_train_seconds: float) -> None:
        self._advance(self.productive_seconds, acked_train_seconds)

    def host_wait(self, total_seconds: float) -> None:
        self._advance(self.host_wait_seconds, total_seconds)

    def badput(self, reason: str, seconds: float) -> None:
        """reason: startup (interpreter, data, compilation) or state_pull (joining)."""
        self.badput_seconds.labels(*self._labels, reason).inc(max(0.0, seconds))


def serve(port: int, registry: CollectorRegistry, ready: Callable[[], bool]) -> ThreadingHTTPServer:
    """/metrics (any path) for Prometheus, and /readyz for the pod's readiness probe: 503 until
    the learner has joined, so a learner that starts but cannot reach or is refused by the syncer
    never counts as ready."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path.split("?", 1)[0] == "/readyz":
                ok = ready()
                body, code, kind = (b"joined\n" if ok else b"not joined to the syncer yet\n"), 200 if ok else 503, \
                    "text/plain; charset=utf-8"
            else:
                body, code, kind = generate_latest(registry), 200, CONTENT_TYPE_LATEST
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass  # probes every few seconds: not worth a log line

    server = ThreadingHTTPServer(("0.0.0.0", port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
