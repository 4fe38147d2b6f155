"""Prometheus metrics of one learner (names per Prometheus conventions, bounded labels)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

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
        self._labels = values
        self._sent = self._received = 0
        self._productive = 0.0
        if port is not None:
            start_http_server(port, addr="0.0.0.0", registry=r)

    def step(self, seconds: float, tokens: int, loss: float) -> None:
        self.steps.inc()
        self.tokens.inc(tokens)
        self.step_seconds.observe(seconds)
        self.loss.set(loss)

    def network(self, sent: int, received: int) -> None:
        """Totals from the client; counters advance by the difference."""
        self.sent.inc(max(0, sent - self._sent))
        self.received.inc(max(0, received - self._received))
        self._sent, self._received = sent, received

    def productive(self, acked_train_seconds: float) -> None:
        self.productive_seconds.inc(max(0.0, acked_train_seconds - self._productive))
        self._productive = max(self._productive, acked_train_seconds)

    def badput(self, reason: str, seconds: float) -> None:
        """reason: startup (interpreter, data, compilation) or state_pull (joining)."""
        self.badput_seconds.labels(*self._labels, reason).inc(max(0.0, seconds))
