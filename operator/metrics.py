"""The operator's own Prometheus metrics: reconciles, learner losses and re-admissions, refused
child writes, goodput, each job's phase and its capacity wait.

Per-job series carry `diloco_namespace` and `diloco_job` labels (not `namespace`/`job`, which
Prometheus sets on every target and would rename ours to `exported_*`) and are removed when
the job goes, so the label sets stay bounded by the jobs that exist.
"""

from __future__ import annotations

import contextlib
from typing import get_args

from prometheus_client import CollectorRegistry, Counter, Gauge

from diloco.spec import Phase

JOB_LABELS = ["diloco_namespace", "diloco_job"]
PHASES: tuple[str, ...] = get_args(Phase)
OUTCOMES = ("ok", "invalid", "error")  # of a reconcile


class OperatorMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        r = self.registry = registry or CollectorRegistry()
        self.reconciles = Counter("diloco_operator_reconciles_total",
                                  "Job reconciliations by outcome (ok, invalid, error: an exception left the pass)",
                                  ["outcome"], registry=r)
        for outcome in OUTCOMES:  # every series from 0, so increase() sees the first error
            self.reconciles.labels(outcome)
        # By kind and reason only, not by job: the condition and Event on the job say which one.
        self.refused_writes = Counter("diloco_operator_child_writes_refused_total",
                                      "Child writes the API server refused (quota, webhook, RBAC, invalid)",
                                      ["kind", "reason"], registry=r)
        self.losses = Counter("diloco_operator_learner_losses_total", "Learner pods lost, by reason",
                              [*JOB_LABELS, "diloco_group", "reason"], registry=r)
        self.readmissions = Counter("diloco_operator_learner_readmissions_total",
                                    "Lost learners whose pod became ready again", [*JOB_LABELS, "diloco_group"],
                                    registry=r)
        self.restarts = Counter("diloco_operator_learner_restarts_total",
                                "Multi-host learners restarted as a whole after losing a host",
                                [*JOB_LABELS, "diloco_group"], registry=r)
        self.chaos_kills = Counter("diloco_operator_chaos_kills_total", "Pods deleted by chaos injection",
                                   JOB_LABELS, registry=r)
        self.forced_deletions = Counter("diloco_operator_forced_deletions_total",
                                        "Pods force-deleted after being stuck Terminating", JOB_LABELS, registry=r)
        self.goodput = Gauge("diloco_job_goodput_ratio",
                             "Tokens merged into the global model over what the desired learners could have trained",
                             JOB_LABELS, registry=r)
        self.availability = Gauge("diloco_job_availability_ratio",
                                  "Share of desired learner-time the syncer saw learners connected", JOB_LABELS, registry=r)
        self.badput = Gauge("diloco_job_badput_ratio", "Share of the capacity lost, by reason (down, refused, other)",
                            [*JOB_LABELS, "reason"], registry=r)
        # The sums behind goodput, for rates over a window (the GoodputLow alert): a cumulative
        # ratio moves too slowly on a long job.
        self.useful_tokens = Gauge("diloco_job_useful_tokens", "Tokens merged into the global model while running",
                                   JOB_LABELS, registry=r)
        self.capacity_tokens = Gauge("diloco_job_capacity_tokens",
                                     "Tokens the desired learners could have trained at their measured rates",
                                     JOB_LABELS, registry=r)
        self.learners = Gauge("diloco_job_learners", "Learners of a job by state (desired, ready)",
                              [*JOB_LABELS, "state"], registry=r)
        # One series per phase, 1 for the job's phase and 0 for the others (kube-state-metrics'
        # kube_pod_status_phase style): `== 1` selects a phase, and a phase change is seen at once.
        self.phase = Gauge("diloco_job_phase", "The job's phase: 1 for its current phase, 0 for the others",
                           [*JOB_LABELS, "phase"], registry=r)
        # Pods the scheduler cannot place (operator/failures/capacity.py): a wait, not a failure; the alert is on its length.
        self.unschedulable_pods = Gauge("diloco_job_unschedulable_pods", "Pods of the job waiting for capacity now",
                                        JOB_LABELS, registry=r)
        self.unschedulable_seconds = Gauge("diloco_job_unschedulable_seconds",
                                           "How long the job's longest-waiting unschedulable pod has waited (0: none)",
                                           JOB_LABELS, registry=r)
        # spec.syncer.standby: takeovers counted in the job's status (status.syncer.takeovers), and
        # the lease epoch; a rise of either is a takeover (alert on changes(...[1h]) > 0).
        self.syncer_takeovers = Gauge("diloco_job_syncer_takeovers",
                                      "Times a standby syncer took over from a silent active one", JOB_LABELS, registry=r)
        self.syncer_lease_epoch = Gauge("diloco_job_syncer_lease_epoch", "The syncer lease's epoch", JOB_LABELS,
                                        registry=r)

    def job_status(self, namespace: str, job: str, status: dict[str, object],
                   capacity_tokens: float | None = None) -> None:
        for gauge, key in ((self.goodput, "goodput"), (self.availability, "availability")):
            value = status.get(key)
            if isinstance(value, (int, float)):
                gauge.labels(namespace, job).set(value)
        badput = status.get("badput")
        if isinstance(badput, dict):
            for reason, share in badput.items():
                self.badput.labels(namespace, job, reason).set(share)
        accounting = status.get("accounting")
        if isinstance(accounting, dict) and isinstance(accounting.get("usefulTokens"), int):
            self.useful_tokens.labels(namespace, job).set(accounting["usefulTokens"])
        if capacity_tokens is not None:
            self.capacity_tokens.labels(namespace, job).set(capacity_tokens)
        for state, key in (("desired", "desiredLearners"), ("ready", "readyLearners")):
            value = status.get(key)
            if isinstance(value, int):
                self.learners.labels(namespace, job, state).set(value)
        syncer = status.get("syncer")
        if isinstance(syncer, dict) and isinstance(syncer.get("leaseEpoch"), int):
            self.syncer_lease_epoch.labels(namespace, job).set(syncer["leaseEpoch"])
            self.syncer_takeovers.labels(namespace, job).set(int(syncer.get("takeovers") or 0))
        phase = status.get("phase")
        if isinstance(phase, str):
            for each in PHASES:
                self.phase.labels(namespace, job, each).set(1 if each == phase else 0)

    def capacity_wait(self, namespace: str, job: str, pods: int, longest_seconds: float) -> None:
        """Pods of the job the scheduler cannot place, and the longest one's wait."""
        self.unschedulable_pods.labels(namespace, job).set(pods)
        self.unschedulable_seconds.labels(namespace, job).set(longest_seconds)

    def forget(self, namespace: str, job: str) -> None:
        """Drop a deleted job's gauges (counters stay until restart, as Prometheus expects)."""
        for gauge, extra in ((self.goodput, [()]), (self.availability, [()]), (self.useful_tokens, [()]),
                             (self.capacity_tokens, [()]), (self.badput, [("down",), ("refused",), ("other",)]),
                             (self.learners, [("desired",), ("ready",)]), (self.phase, [(p,) for p in PHASES]),
                             (self.unschedulable_pods, [()]), (self.unschedulable_seconds, [()]),
                             (self.syncer_takeovers, [()]), (self.syncer_lease_epoch, [()])):
            for rest in extra:
                with contextlib.suppress(KeyError):  # never set for this job
                    gauge.remove(namespace, job, *rest)
