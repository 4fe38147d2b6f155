"""Folds the event stream of a local run into the state the view and the summary read (the
figures derived from it: apps/local/figures.py).

Pure bookkeeping over events (each has `t`, `event` and `source`), so it can be
replayed from events.jsonl and tested without processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from diloco.apps.local.figures import Incarnation, RunFigures, Slot
from diloco.contract import REFUSED_WITHOUT_WORK, Event


@dataclass
class RunTracker(RunFigures):
    """A run's state, folded from its events; what it means: RunFigures (apps/local/figures.py)."""

    learners: list[str]
    slots: dict[str, Slot] = field(init=False)
    kills: list[tuple[float, str]] = field(default_factory=list)
    evals: list[tuple[float, str, float]] = field(default_factory=list)
    status: list[tuple[float, int, int]] = field(default_factory=list)  # (t, tokens_merged, versions)
    tokens_merged: int = 0
    outer_versions: int = 0
    outer_steps: int = 0
    active_learners: int = 0
    syncer_incarnations: set[str] = field(default_factory=set)
    syncer_up_since: float | None = None
    some_up_since: float | None = None
    max_publish_gap: float = 0.0
    last_chaos: str = ""
    refused: int = 0
    refused_by: dict[str, int] = field(default_factory=dict)  # by outcome, this syncer incarnation
    refused_work: int = 0  # pushes refused for what they held, every incarnation (badput)
    _refused_work_now: int = 0  # of the current incarnation
    max_norm_ratio: float = 0.0  # the largest push norm over its fragment's median, any incarnation
    max_steps_ratio: float = 0.0  # the largest push steps over its bound's base (syncer/acceptance.py Counters)

    def __post_init__(self) -> None:
        self.slots = {n: Slot(n) for n in self.learners}

    @property
    def up_count(self) -> int:
        return sum(s.up for s in self.slots.values())

    def observe(self, e: dict[str, Any]) -> None:
        t, kind, src = float(e.get("t", 0.0)), e.get("event"), e.get("source")
        if src in self.slots:
            self._learner_event(self.slots[src], t, kind, e)
        elif src == "runner":
            self._runner_event(t, kind, e)

    def _learner_event(self, slot: Slot, t: float, kind: Any, e: dict[str, Any]) -> None:
        if kind == Event.JOINED:
            if self.up_count == 0:
                self.some_up_since = t
            spawned = slot.spawned_at if slot.spawned_at is not None else t
            slot.incarnations.append(Incarnation(int(e.get("restart", 0)), t, float(e.get("eval_loss", "nan")),
                                                 spawned, float(e.get("pull_seconds", 0.0))))
            slot.spawned_at = None
            if slot.down_at is not None:
                slot.intervals.append((slot.down_at, t, "down"))
                slot.down_at = None
            slot.up = True
        elif kind in (Event.PROGRESS, Event.EXIT) and slot.incarnations:
            inc = slot.incarnations[-1]
            inc.train_seconds = float(e.get("train_seconds", inc.train_seconds))
            inc.acked_train_seconds = float(e.get("acked_train_seconds", inc.acked_train_seconds))
            inc.bytes_sent = int(e.get("bytes_sent", inc.bytes_sent))
            inc.bytes_received = int(e.get("bytes_received", inc.bytes_received))
            inc.steps = int(e.get("step", inc.steps))
            inc.trained_tokens = int(e.get("trained_tokens", inc.trained_tokens))
            if kind == Event.EXIT:
                self._down(slot, t, killed=False)
        elif kind == Event.EVAL:
            self.evals.append((t, slot.name, float(e["eval_loss"])))

    def _down(self, slot: Slot, t: float, killed: bool) -> None:
        if slot.spawned_at is not None:  # died before it joined
            slot.unjoined_seconds += t - slot.spawned_at
            slot.spawned_at = None
        if slot.up and slot.incarnations:
            inc = slot.incarnations[-1]
            inc.end, inc.killed = t, killed
            slot.intervals.append((inc.joined_at, t, "up"))
        slot.up = False
        slot.down_at = t

    def _runner_event(self, t: float, kind: Any, e: dict[str, Any]) -> None:
        target = e.get("target")
        if kind == "kill":
            self.kills.append((t, str(target)))
            self.last_chaos = f"killed {target}"
            if target in self.slots:
                self._down(self.slots[target], t, killed=True)
            elif target == "syncer":
                self.syncer_up_since = None
        elif kind == "exited" and target in self.slots:
            self._down(self.slots[target], t, killed=True)
        elif kind == "exited" and target == "syncer":
            self.syncer_up_since = None
        elif kind == "restart":
            self.last_chaos = f"restarted {target}"
        elif kind == "spawned" and target in self.slots:
            self.slots[target].spawned_at = t
        elif kind == "status":
            self._status(t, e)

    def _status(self, t: float, e: dict[str, Any]) -> None:
        incarnation = str(e.get("incarnation", ""))
        if incarnation not in self.syncer_incarnations:
            self.syncer_incarnations.add(incarnation)
            self.syncer_up_since = t
        self.tokens_merged = int(e["tokens_merged"])
        self.outer_versions = int(sum(e["versions"]))
        self.outer_steps = int(e["outer_steps"])
        self.active_learners = int(e["active_learners"])
        self.refused = int(e.get("refused", 0))
        self.refused_by = {str(k): int(v) for k, v in dict(e.get("refused_by", {})).items()}
        work = sum(v for k, v in self.refused_by.items() if k not in REFUSED_WITHOUT_WORK)
        if work < self._refused_work_now:  # a new syncer incarnation counts from 0
            self._refused_work_now = 0
        self.refused_work += work - self._refused_work_now
        self._refused_work_now = work
        self.max_norm_ratio = max(self.max_norm_ratio, float(e.get("max_norm_ratio", 0.0)))
        self.max_steps_ratio = max(self.max_steps_ratio, float(e.get("max_steps_ratio", 0.0)))
        for name, tokens in dict(e.get("learners_trained", {})).items():
            if name in self.slots:
                self.slots[name].reported_tokens = max(self.slots[name].reported_tokens, int(tokens))
        self.status.append((t, self.tokens_merged, self.outer_versions))
        # A publishing gap counts only while the syncer and at least one joined learner are up.
        if self.up_count and self.syncer_up_since is not None and self.some_up_since is not None:
            since = max(t - float(e["seconds_since_publish"]), self.some_up_since, self.syncer_up_since)
            self.max_publish_gap = max(self.max_publish_gap, t - since)
