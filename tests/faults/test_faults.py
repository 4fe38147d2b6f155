"""Fault injection against a real job: processes killed, frozen, cut off, starved, poisoned.

Two small jobs run as real processes on 127.0.0.1 (tests/faults/cluster.py), one at a time:

- `TestLearnerFaults`: a syncer and three learners. local-2 poisons itself with NaN at step
  30, later hangs (SIGSTOP) and is SIGKILLed while hung; local-0 is SIGKILLed mid-push and
  re-admitted, then SIGSTOPped and continued; local-1 talks to the syncer through a TCP proxy
  (tests/faults/proxy.py) that drops, stalls and slows its connection.
- `TestSyncerFaults`: a syncer checkpointing every 0.05 s and two learners. The syncer is
  SIGKILLed while merges stream, during a checkpoint write, and once more with its newest
  checkpoint torn afterwards; then its checkpoint directory turns into a regular file while
  it runs, and back.

Every fault moment and duration comes from a seeded RNG and is defined by events (the k-th
progress report, N more merges, N more steps), and every wait has a deadline. The figures of
docs/OPERATIONS.md come from these tests: `pytest tests/faults/test_faults.py -s` prints them, and
with DILOCO_FAULT_FIGURES=path they are also written there as JSON.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from diloco.checkpoint import CheckpointStore, deserialize
from tests.faults.cluster import Cluster, Status

pytestmark = pytest.mark.e2e

SEED = 20261129
NAN_STEP = 30
UNTRAINED_LOSS = math.log(256)  # nats per byte of a model that knows nothing
SLOW_BYTES_PER_SECOND = 48_000  # about 2 int4 fragment pushes a second; publishes are fp32
FIGURES: dict[str, dict[str, Any]] = {}


def record(kind: str, **figures: Any) -> None:
    row = FIGURES.setdefault(kind, {"injected": 0, "survived": 0})
    row["injected"] += 1
    row["survived"] += 1  # only reached when every assertion about the fault held
    for key, value in figures.items():
        row[key] = row.get(key, 0) + value if isinstance(value, (int, float)) else value


@pytest.fixture(scope="module", autouse=True)
def report_figures() -> Iterator[None]:
    yield
    if not FIGURES:
        return
    print("\nfault-injection figures:")
    for kind, row in FIGURES.items():
        print(f"  {kind}: {json.dumps(row, sort_keys=True)}")
    out = os.environ.get("DILOCO_FAULT_FIGURES")
    if out:
        Path(out).write_text(json.dumps(FIGURES, indent=2, sort_keys=True))


def finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def metric(c: Cluster, name: str, sample: str, **labels: str) -> float:
    want = tuple(sorted(labels.items()))
    return sum(v for (n, lab), v in c.metrics(name).items() if n == sample and all(kv in lab for kv in want))


def staleness(c: Cluster) -> tuple[float, float]:
    """(contributions refused as stale, contributions merged with a lag of one version or more)."""
    m = c.metrics("syncer")
    stale = sum(v for (n, lab), v in m.items() if n == "diloco_syncer_contributions_total" and ("outcome", "stale") in lab)
    count = sum(v for (n, _), v in m.items() if n == "diloco_syncer_contribution_staleness_versions_count")
    fresh = sum(v for (n, lab), v in m.items()
                if n == "diloco_syncer_contribution_staleness_versions_bucket" and ("le", "0.0") in lab)
    return stale, count - fresh


def incarnation_statuses(c: Cluster, incarnation: str) -> list[Status]:
    with c.cond:
        return [s for s in c.statuses if s.incarnation == incarnation]


def assert_versions_monotonic(c: Cluster) -> None:
    """Within one syncer incarnation no fragment's version ever decreases."""
    with c.cond:
        statuses = list(c.statuses)
    last: dict[str, list[int]] = {}
    for s in statuses:
        prev = last.get(s.incarnation)
        if prev is not None:
            assert all(a >= b for a, b in zip(s.versions, prev)), (prev, s.versions)
        last[s.incarnation] = s.versions


def assert_checkpoint_sound(directory: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    loaded, skipped = CheckpointStore(directory).load_latest()
    assert loaded is not None, f"no valid checkpoint in {directory}: {skipped}"
    arrays, meta = deserialize(loaded.path.read_bytes())  # verifies the checksum again
    assert all(np.all(np.isfinite(a)) for a in arrays.values()), "a checkpoint holds NaN or Inf"
    return arrays, meta


def nth_progress(c: Cluster, name: str, k: int, after: float, timeout: float = 30.0) -> dict[str, Any]:
    """The k-th progress report of `name` after `after`: a seeded, event-defined moment."""
    return c.wait_for(lambda: (p := c.select(name, "progress", after)) and len(p) >= k and p[k - 1], timeout,
                      f"{k} progress reports from {name}")


def acked_beyond(c: Cluster, name: str, after: float, acked: float, run: int, timeout: float = 60.0) -> dict[str, Any]:
    """A progress report after `after` showing training the syncer accepted beyond `acked`."""
    return c.wait_for(
        lambda: next((e for e in c.select(name, "progress", after) if e["run"] == run and e["acked_train_seconds"] > acked),
                     None), timeout, f"the syncer to accept pushes from {name} again")


# ---------------------------------------------------------------------------------------
# Learners: SIGKILL, SIGSTOP/SIGCONT, network faults through a proxy, NaN
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="class")
def learner_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Syncer + three learners; local-1 behind the proxy, local-2 poisons itself at step 30.
    Class-scoped: torn down (every process group killed) as soon as its class is done."""
    root = tmp_path_factory.mktemp("learner-faults")
    c = Cluster(root, "faults-learners", 3, checkpoint_dir=root / "ckpt", via_proxy=(1,),
                learner_args={2: ["--inject-nan-at-step", str(NAN_STEP)]})
    try:
        c.start_syncer()
        for i in range(3):
            c.start_learner(i)
        for name in c.learners:
            c.wait_event(name, "joined", timeout=150)
        # Joined is not yet training: a test drawn first (the order is random) needs every learner's
        # first progress report to measure against.
        c.wait_for(lambda: all(c.last(n, "progress") for n in c.learners), 60, "a progress report from every learner")
        yield c
    finally:
        c.close()


@pytest.mark.timeout(300)
class TestLearnerFaults:
    rng = random.Random(SEED)

    @pytest.fixture
    def job(self, learner_job: Cluster) -> Cluster:
        return learner_job

    def test_diverged_learner_is_refused_and_resynced(self, job: Cluster) -> None:
        c, name = job, "local-2"
        refused = c.wait_event(name, "push_refused", timeout=60,
                               where=lambda e: "non-finite" in e["reason"] or "NaN" in e["reason"])
        # The poisoned weights give a NaN loss one step later ("diverged"), unless global fragments
        # replaced all of them first; either way the refusal alone makes it re-sync ("resynced").
        diverged = c.wait_for(lambda: next(iter(c.select(name, where=lambda e: e["event"] in ("diverged", "resynced")
                                                         and e["step"] > NAN_STEP)), None),
                              30, "local-2 to re-sync from the global model")
        t = max(refused["seen"], diverged["seen"])
        acked = max((e["acked_train_seconds"] for e in c.select(name, "progress") if e["seen"] <= t), default=0.0)
        # It re-synced from the global model and keeps training: finite loss, pushes accepted again.
        back = acked_beyond(c, name, t, acked, run=0)
        later = c.wait_steps(name, 20, after=back["seen"])
        assert all(finite(e["loss"]) for e in c.select(name, "progress", t) if e["seen"] <= later["seen"])
        # The bad outer gradient never reached the global model: the other learners stayed finite.
        for other in ("local-0", "local-1"):
            assert all(finite(e["loss"]) for e in c.select(other, "progress"))
        # Refused as undecodable (an int4 block scale of NaN) or as non-finite values (fp32, bf16).
        refusals = (metric(c, "syncer", "diloco_syncer_contributions_total", outcome=o) for o in ("invalid", "nonfinite"))
        assert sum(refusals) >= 1
        poisoned = c.select(name, "push_refused", where=lambda e: "non-finite" in e["reason"] or "NaN" in e["reason"])
        record("learner NaN (diverged)", refused_pushes=len(poisoned), resync_seconds=round(back["seen"] - t, 2),
               merges_poisoned=0)

    def test_learner_sigkill_mid_push_is_readmitted(self, job: Cluster) -> None:
        c, name = job, "local-0"
        last = nth_progress(c, name, self.rng.randint(1, 4), after=time.time())
        t_kill = c.kill(name)  # right after a progress report: pushes stream one per step
        before = c.latest_status()
        assert before is not None
        lost = last["train_seconds"] - last["acked_train_seconds"]
        # The job goes on without it: the syncer sees it gone and keeps merging.
        c.wait_for(lambda: (s := c.latest_status()).active_learners == 2 and s.outer_steps >= before.outer_steps + 20,
                   30, "merges to continue with local-0 dead")
        c.restart(name)
        joined = c.wait_event(name, "joined", after=t_kill, timeout=90)
        assert joined["restart"] == 1
        # Re-admitted with the current global model, not a fresh one.
        assert all(j >= b for j, b in zip(joined["versions"], before.versions)), (joined["versions"], before.versions)
        assert joined["eval_loss"] < UNTRAINED_LOSS - 1.0, joined["eval_loss"]
        acked_beyond(c, name, t_kill, 0.0, run=1)
        c.wait_for(lambda: c.latest_status().active_learners == 3, 30, "three active learners again")
        record("learner SIGKILL (mid-push)", lost_learner_seconds=round(lost, 3),
               readmission_seconds=round(joined["seen"] - t_kill, 2))

    def test_learner_sigstop_sigcont(self, job: Cluster) -> None:
        c, name = job, "local-0"
        last = nth_progress(c, name, self.rng.randint(1, 3), after=time.time())
        stale_before = staleness(c)
        t_stop = c.kill(name, signal.SIGSTOP)
        s0 = c.latest_status()
        hold = self.rng.randint(80, 160)  # a few seconds of merges by the others
        c.wait_for(lambda: c.latest_status().outer_steps >= s0.outer_steps + hold, 40,
                   f"{hold} merges while local-0 is frozen")
        frozen = [e for e in c.select(name, "progress", t_stop + 0.5) if e["t"] > t_stop]
        assert not frozen, "a SIGSTOPped learner reported progress"
        t_cont = c.kill(name, signal.SIGCONT)
        # It resumes where it stopped: same process, more steps, pushes accepted again.
        resumed = acked_beyond(c, name, t_cont, last["acked_train_seconds"], run=last["run"])
        assert resumed["step"] > last["step"]
        stale, lagged = (a - b for a, b in zip(staleness(c), stale_before))
        record("learner SIGSTOP/SIGCONT", frozen_seconds=round(t_cont - t_stop, 2), stale_refused=stale,
               merged_with_lag=lagged, lost_learner_seconds=0)

    def test_frozen_learner_sigkilled_and_readmitted(self, job: Cluster) -> None:
        """A hung learner (SIGSTOP) that its liveness probe then kills (SIGKILL while stopped)."""
        c, name = job, "local-2"
        last = nth_progress(c, name, self.rng.randint(1, 3), after=time.time())
        t_stop = c.kill(name, signal.SIGSTOP)
        s0 = c.latest_status()
        hold = self.rng.randint(100, 200)  # a few seconds of merges by the others
        c.wait_for(lambda: c.latest_status().outer_steps >= s0.outer_steps + hold, 40,
                   f"{hold} merges while local-2 hangs")
        t_kill = c.kill(name)
        before = c.latest_status()
        c.restart(name)
        joined = c.wait_event(name, "joined", after=t_kill, timeout=90)
        assert all(j >= b for j, b in zip(joined["versions"], before.versions))
        acked_beyond(c, name, t_kill, 0.0, run=c.procs[name].restarts)
        c.wait_for(lambda: c.latest_status().active_learners == 3, 30, "three active learners again")
        record("learner SIGSTOP then SIGKILL (hung)", hung_seconds=round(t_kill - t_stop, 2),
               lost_learner_seconds=round(last["train_seconds"] - last["acked_train_seconds"], 3),
               readmission_seconds=round(joined["seen"] - t_kill, 2))

    @pytest.mark.parametrize("mode", ["drop", "stall", "slow"])
    def test_network_fault_between_learner_and_syncer(self, job: Cluster, mode: str) -> None:
        c, name = job, "local-1"
        proxy = c.proxies[name]
        steps = self.rng.randint(25, 45)
        prev = c.last(name, "progress")
        assert prev is not None
        stale_before = staleness(c)
        refused_before = c.latest_status().refused
        up_before = proxy.stats.upstream_bytes
        t = time.time()
        proxy.set_mode(mode, rate=SLOW_BYTES_PER_SECOND)
        # The learner keeps stepping whatever the network does.
        during = c.wait_steps(name, steps, after=t, timeout=40)
        if mode == "drop":
            c.wait_event(name, "disconnected", after=t, timeout=20)
            assert proxy.stats.dropped >= 1
        elif mode == "stall":
            c.wait_for(lambda: c.latest_status().learners[name]["seconds_since_seen"] > 1.0, 20,
                       "the syncer to stop hearing from local-1")
        else:
            elapsed = time.time() - t
            sent = proxy.stats.upstream_bytes - up_before
            assert sent <= SLOW_BYTES_PER_SECOND * (elapsed + 0.5) + 65536, (sent, elapsed)
        t_fault = time.time() - t
        proxy.set_mode("pass")
        t_pass = time.time()
        # It reconnects and its contributions are accepted again.
        back = acked_beyond(c, name, t_pass, during["acked_train_seconds"], run=0, timeout=60)
        stale, lagged = (a - b for a, b in zip(staleness(c), stale_before))
        record(f"network {mode} (learner <-> syncer)", fault_seconds=round(t_fault, 2),
               steps_during_fault=during["step"] - prev["step"], stale_refused=stale, merged_with_lag=lagged,
               refused_total=c.latest_status().refused - refused_before,
               reconnect_seconds=round(back["seen"] - t_pass, 2),
               disconnects=len(c.select(name, "disconnected", t)))

    def test_stale_contributions_were_handled_by_the_policy(self, job: Cluster) -> None:
        """Cut-off and frozen learners came back with outer gradients against old versions: the
        syncer either down-weighted them (lag within staleness.maxVersions = 2) or refused them."""
        stale, lagged = staleness(job)
        assert stale + lagged > 0
        if stale:  # a refused learner is told why
            assert job.select(where=lambda e: e["event"] == "push_refused" and "behind" in e["reason"])

    def test_state_is_finite_and_versions_monotonic(self, job: Cluster) -> None:
        c = job
        assert_versions_monotonic(c)
        assert len({s.incarnation for s in c.statuses}) == 1  # the syncer never restarted
        t = time.time()
        for name in c.learners:
            c.wait_steps(name, 10, after=t)
        assert c.latest_status().active_learners == 3
        c.wait_for(lambda: c.latest_status().checkpoint_version > 0, 20, "a checkpoint")
        assert_checkpoint_sound(c.checkpoint_dir)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------
# The syncer: SIGKILL mid-merge, mid-checkpoint, torn checkpoint, unwritable directory
# ---------------------------------------------------------------------------------------


def tmp_debris(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.name.startswith(".ckpt-") and ".tmp-" in p.name] if directory.is_dir() else []


@pytest.fixture(scope="class")
def syncer_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Syncer checkpointing every 0.05 s (it is writing one most of the time, so kills land in
    writes) and two learners."""
    root = tmp_path_factory.mktemp("syncer-faults")
    # The syncer writes through a symlink, so a test can swap the directory for a regular file
    # and back atomically (os.replace) while the syncer runs; the volume itself stays intact.
    (root / "volume").mkdir()
    (root / "ckpt").symlink_to(root / "volume", target_is_directory=True)
    c = Cluster(root, "faults-syncer", 2, checkpoint_dir=root / "ckpt", syncer={"checkpointIntervalSeconds": 0.05})
    try:
        c.start_syncer()
        for i in range(2):
            c.start_learner(i)
        for name in c.learners:
            c.wait_event(name, "joined", timeout=150)
        c.wait_for(lambda: (s := c.latest_status()).outer_steps >= 40 and s.checkpoint_version > 0
                   and all(c.last(n, "progress") for n in c.learners), 60, "40 merges, a checkpoint, progress reports")
        yield c
    finally:
        c.close()


@pytest.mark.timeout(300)
class TestSyncerFaults:
    rng = random.Random(SEED + 1)

    @pytest.fixture
    def job(self, syncer_job: Cluster) -> Cluster:
        return syncer_job

    def kill_and_recover(self, c: Cluster, kind: str, kill: Any, tear: bool = False) -> None:
        """SIGKILL the syncer (via `kill`), check what is on disk, restart it, and check that
        versions never fall below the checkpoint and that learners hand back newer merges."""
        directory: Path = c.checkpoint_dir  # type: ignore[assignment]
        before = c.latest_status()
        held_before = {n: c.last(n, "progress")["versions"] for n in c.learners}  # type: ignore[index]
        merge_rate = self.merge_rate(c)
        old_debris = {p.name for p in tmp_debris(directory)}
        t_kill = kill()
        after_kill = c.latest_status()
        assert after_kill is not None and after_kill.incarnation == before.incarnation
        held = {n: (c.last(n, "progress") or {}).get("versions", held_before[n]) for n in c.learners}
        debris = [p for p in tmp_debris(directory) if p.name not in old_debris]  # left by this kill
        if tear:  # what a filesystem without atomic rename could leave: the newest file cut short
            newest = max(directory.glob("ckpt-*.ddck"))
            newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
        loaded, skipped = CheckpointStore(directory).load_latest()
        assert loaded is not None, skipped
        deserialize(loaded.path.read_bytes())  # the one the syncer will load verifies
        for path in debris:  # torn temporary files are never candidates for loading
            assert path.name not in {p.name for p in directory.glob("ckpt-*.ddck")}
        if tear:
            assert skipped and "checksum" in skipped[0]
        ckpt_versions = list(loaded.meta["versions"])  # type: ignore[arg-type]

        c.restart("syncer")
        new = c.latest_status()
        assert new.incarnation != before.incarnation
        log = c.log("syncer").rsplit("=== ", 1)[-1]
        assert f"resumed from {loaded.path.name}" in log, log[-2000:]
        if tear:
            assert "skipping corrupt checkpoint" in log and "checksum" in log
        first = incarnation_statuses(c, new.incarnation)[0]
        # Versions never go back past the checkpoint ...
        assert all(f >= k for f, k in zip(first.versions, ckpt_versions)), (first.versions, ckpt_versions)
        # ... and learners re-join, handing back every merge they had received (Recover).
        for n in c.learners:
            c.wait_event(n, "rejoined", after=t_kill, timeout=60)
        settled = c.wait_for(lambda: (s := c.latest_status()).incarnation == new.incarnation and s.active_learners == 2
                             and s, 30, "both learners subscribed to the new syncer")
        for p in range(len(settled.versions)):
            newest_held = max(v[p] for v in held.values())
            assert settled.versions[p] >= newest_held, (p, settled.versions, held)
        recovered = c.select(kind="recovered", after=t_kill)
        restored = recovered[0]["versions"] if recovered else first.versions
        lost = sum(max(0, b - r) for b, r in zip(after_kill.versions, restored))
        # Training goes on.
        c.wait_for(lambda: (s := c.latest_status()).incarnation == new.incarnation
                   and s.outer_steps >= settled.outer_steps + 20, 60, "merges on the new syncer")
        assert_versions_monotonic(c)
        record(kind, merges_per_second_at_kill=round(merge_rate, 1),
               merges_lost_vs_last_status=lost, versions_behind_learners=0,
               behind_checkpoint=sum(max(0, b - a) for a, b in zip(first.versions, ckpt_versions)),
               fragments_recovered_from_learners=sum(len(e["fragments"]) for e in recovered),
               torn_temp_files=len(debris),
               corrupt_skipped=len(skipped),
               downtime_seconds=round(settled.t - t_kill, 2))

    def merge_rate(self, c: Cluster) -> float:
        with c.cond:
            recent = [s for s in c.statuses if s.t > time.time() - 3]
        if len(recent) < 2 or recent[-1].incarnation != recent[0].incarnation:
            return 0.0
        return (recent[-1].outer_steps - recent[0].outer_steps) / max(recent[-1].t - recent[0].t, 1e-3)

    def test_syncer_killed_mid_merge(self, job: Cluster) -> None:
        c = job

        def kill() -> float:
            # A seeded moment while merges stream (tens a second): the k-th status poll that
            # shows new merges since the previous one.
            k, seen = self.rng.randint(2, 6), 0
            prev = c.latest_status().outer_steps

            def moving() -> bool:
                nonlocal seen, prev
                s = c.latest_status()
                if s.outer_steps > prev:
                    seen, prev = seen + 1, s.outer_steps
                return seen >= k
            c.wait_for(moving, 30, "merges streaming")
            return c.kill("syncer")

        self.kill_and_recover(c, "syncer SIGKILL (mid-merge)", kill)

    def test_syncer_killed_mid_checkpoint(self, job: Cluster) -> None:
        c = job
        directory: Path = c.checkpoint_dir  # type: ignore[assignment]

        def kill() -> float:
            old = {p.name for p in tmp_debris(directory)}
            pid = c.procs["syncer"].popen.pid  # type: ignore[union-attr]
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # spin: a write lasts milliseconds
                if any(p.name not in old and p.name.endswith(f".tmp-{pid}") for p in tmp_debris(directory)):
                    return c.kill("syncer")
            raise AssertionError("the syncer wrote no checkpoint within 20 s")

        self.kill_and_recover(c, "syncer SIGKILL (mid-checkpoint)", kill)

    def test_torn_newest_checkpoint_is_skipped(self, job: Cluster) -> None:
        c = job

        def kill() -> float:
            nth_progress(c, "local-0", self.rng.randint(1, 3), after=time.time())
            return c.kill("syncer")

        self.kill_and_recover(c, "syncer SIGKILL + torn newest checkpoint", kill, tear=True)

    def test_unwritable_checkpoint_directory(self, job: Cluster) -> None:
        """The checkpoint directory's path turns into a regular file while the syncer runs (a
        volume gone bad; permissions cannot stand in for this, as CI runs as root)."""
        c = job
        directory: Path = c.checkpoint_dir  # type: ignore[assignment]
        volume = Path(os.readlink(directory))
        blocker = directory.with_name("not-a-directory")
        blocker.write_text("a regular file where the checkpoint directory should be\n")
        c.wait_for(lambda: c.latest_status().checkpoint_version > 0, 30, "a checkpoint by this syncer")
        errors0 = metric(c, "syncer", "diloco_syncer_checkpoint_errors_total")
        log0 = c.log("syncer").count("checkpoint failed in")

        def point_at(target: Path) -> None:
            link = directory.with_name(".ckpt-swap")
            link.symlink_to(target)
            os.replace(link, directory)  # atomic: the syncer sees the old target or the new one

        point_at(blocker)
        s0 = c.latest_status()
        try:
            # A clear error in the log and the metric, and training goes on.
            c.wait_for(lambda: c.log("syncer").count("checkpoint failed in") >= log0 + 1, 30, "checkpoint errors logged")
            t_err = time.time()  # every checkpoint after the first failure fails: the figure is final
            stuck = c.wait_for(lambda: (s := c.latest_status()).t > t_err and s, 5,
                               "a status after the failure").checkpoint_version
            c.wait_for(lambda: c.latest_status().outer_steps >= s0.outer_steps + 30, 30, "merges while checkpoints fail")
            errors = metric(c, "syncer", "diloco_syncer_checkpoint_errors_total") - errors0
            assert errors >= 3
            line = next(x for x in reversed(c.log("syncer").splitlines()) if "checkpoint failed in" in x)
            assert str(directory) in line and "previous checkpoint is intact" in line, line
            # The durable checkpoint did not move on, and the previous ones are intact.
            assert c.latest_status().checkpoint_version == stuck
            _, meta = assert_checkpoint_sound(volume)
            assert sum(meta["versions"]) == stuck  # type: ignore[arg-type]
        finally:
            point_at(volume)
        # Writable again: checkpoints resume on their own.
        c.wait_for(lambda: c.latest_status().checkpoint_version > stuck, 30, "checkpoints to resume")
        assert_checkpoint_sound(directory)
        record("checkpoint directory unwritable", checkpoint_errors=int(errors), merges_lost=0,
               merges_during_outage=c.latest_status().outer_steps - s0.outer_steps)
