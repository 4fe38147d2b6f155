"""A standby syncer takes over from checkpoints in object storage (spec.syncer.standby).

One small job as real processes on 127.0.0.1 (tests/faults/cluster.py): two syncers sharing an
S3 bucket served by moto on 127.0.0.1 (tests/s3_server.py) and a leader lease in it, and two
learners given both syncers' addresses (`a|b`). The fault suite's measures apply: versions
never go back past what learners held, no merge any learner had received is lost, training goes
on; and the time from the kill to the first merge the standby publishes is measured.

- `test_standby_takes_over_from_the_store`: the active syncer is SIGKILLed (it has no volume:
  nothing of it survives but the bucket); the standby takes over from the bucket, learners hand
  back what its checkpoint missed (Recover), merges go on. The killed one comes back as standby.
- `test_frozen_active_is_fenced`: the active syncer is SIGSTOPped while learners hold streams to
  it, the standby takes over, and the frozen one is continued while learners are still
  connected to it: its lease has lapsed, so it publishes nothing, answers nothing, writes no
  checkpoint and exits; every learner ends on the new epoch with versions never going back.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from diloco.checkpoint_objects import open_store
from diloco.contract import incarnation_epoch
from tests.faults.cluster import Cluster, Status
from tests.faults.test_faults import assert_versions_monotonic, metric, record, report_figures  # noqa: F401
from tests.s3_server import s3_bucket

pytestmark = pytest.mark.e2e
LEASE_SECONDS = 4.0
TARGET_SECONDS = 15.0  # issue 62: kill to the standby's first merge


def serving(c: Cluster, name: str, epoch: int) -> Status | None:
    """The newest status from `name`'s port at lease epoch `epoch` or above."""
    port = c.syncer_ports[name]
    with c.cond:
        return next((s for s in reversed(c.statuses) if s.port == port and incarnation_epoch(s.incarnation) >= epoch),
                    None)


def lease_holder(c: Cluster) -> tuple[str, str, int]:
    """(the live syncer serving at the highest lease epoch, the other one, that epoch): each test
    starts from whichever the tests before it left holding the lease, in any order."""
    newest = {n: s for n in ("syncer", "syncer-b") if c.procs[n].alive and (s := serving(c, n, 1)) is not None}
    assert newest, "no live syncer has served"
    active = max(newest, key=lambda n: incarnation_epoch(newest[n].incarnation))
    return active, "syncer" if active == "syncer-b" else "syncer-b", incarnation_epoch(newest[active].incarnation)


def stand_by(c: Cluster, name: str) -> None:
    """`name` running as the standby (restarted if an earlier test killed or fenced it)."""
    if not c.procs[name].alive:
        c.restart(name, wait=False)
    c.wait_for(lambda: "standby:" in c.log(name).rsplit("=== ", 1)[-1], 60, f"{name} to stand by")


def held_versions(c: Cluster) -> dict[str, list[int]]:
    return {n: (c.last(n, "progress") or {}).get("versions", []) for n in c.learners}


def versions_never_went_back(c: Cluster, after: float) -> None:
    """Per learner, no fragment's version in its progress reports ever drops below one it reported before."""
    for n in c.learners:
        high: list[int] = []
        for e in c.select(n, "progress"):
            v = e["versions"]
            if e["seen"] >= after and high:
                assert all(a >= b for a, b in zip(v, high)), (n, v, high)
            high = [max(a, b) for a, b in zip(v, high)] if high else list(v)


@pytest.fixture(scope="module")
def standby_job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    root = tmp_path_factory.mktemp("standby")
    with s3_bucket("standby-job") as bucket:
        syncer = {"checkpointIntervalSeconds": 1.0, "checkpoints": {"url": bucket.url},
                  "standby": {"leaseSeconds": LEASE_SECONDS}}
        c = Cluster(root, "faults-standby", 2, syncer=syncer, checkpoint_dir=bucket.url, syncers=2)
        try:
            c.start_syncer(name="syncer")  # first: it finds no lease and holds epoch 1
            c.start_syncer(name="syncer-b", wait=False)
            c.wait_for(lambda: "standby:" in c.log("syncer-b"), 60, "syncer-b to stand by")
            for i in range(2):
                c.start_learner(i)
            for name in c.learners:
                c.wait_event(name, "joined", timeout=150)
            c.wait_for(lambda: (s := c.latest_status()).outer_steps >= 40 and s.checkpoint_version > 0
                       and all(c.last(n, "progress") for n in c.learners), 60, "40 merges, a checkpoint, progress")
            c.store = open_store(bucket.url)  # type: ignore[attr-defined]
            yield c
        finally:
            c.close()


@pytest.mark.timeout(240)
class TestStandby:
    def takeover(self, c: Cluster, old: str, new: str, epoch: int, t_fault: float,
                 held: dict[str, list[int]]) -> dict[str, Any]:
        """Wait for `new` to serve at `epoch`, learners to re-join it and merges to go on; check
        the fault suite's measures against what learners `held` at the fault."""
        first = c.wait_for(lambda: serving(c, new, epoch), 60, f"{new} to take over at epoch {epoch}")
        t_serving = first.t
        loaded, _ = c.store.load_latest()  # type: ignore[attr-defined]
        assert loaded is not None
        # Not below its checkpoint (it may be above: learners' Recover can land before the first poll).
        ckpt = list(loaded.meta["versions"])  # type: ignore[arg-type]
        merged = c.wait_for(lambda: (s := serving(c, new, epoch)) and s.outer_steps > first.outer_steps and s, 30,
                            f"the first merge published by {new}")
        for n in c.learners:
            c.wait_event(n, "rejoined", after=t_fault, timeout=60,
                         where=lambda e: incarnation_epoch(e["incarnation"]) == epoch)
        settled = c.wait_for(lambda: (s := serving(c, new, epoch)) and s.active_learners == 2 and s, 30,
                             "both learners subscribed to the new syncer")
        newest_held = [max(v[p] for v in held.values() if v) for p in range(len(settled.versions))]
        lost = sum(max(0, h - s) for h, s in zip(newest_held, settled.versions))
        assert lost == 0, (settled.versions, held)  # every merge a learner had received survives
        assert all(f >= k for f, k in zip(settled.versions, ckpt)), (settled.versions, ckpt)
        c.wait_for(lambda: (s := serving(c, new, epoch)) and s.outer_steps >= settled.outer_steps + 20, 60,
                   "merges go on under the new syncer")
        assert_versions_monotonic(c)
        recovered = c.select(kind="recovered", after=t_fault)
        return {"serving_seconds": round(t_serving - t_fault, 2), "first_merge_seconds": round(merged.t - t_fault, 2),
                "merges_lost": lost, "fragments_recovered_from_learners": sum(len(e["fragments"]) for e in recovered)}

    def test_standby_takes_over_from_the_store(self, standby_job: Cluster) -> None:
        c = standby_job
        active, other, epoch = lease_holder(c)  # epoch 1 when this test runs first
        stand_by(c, other)
        c.wait_steps("local-0", 10, after=time.time())
        held = held_versions(c)
        t_kill = c.kill(active)  # SIGKILL: nothing of it survives but the bucket
        held = {n: (c.last(n, "progress") or {}).get("versions", held[n]) for n in c.learners}
        figures = self.takeover(c, active, other, epoch + 1, t_kill, held)
        versions_never_went_back(c, t_kill)
        # A takeover is a metric on the syncer that took over (its process took over once).
        assert metric(c, other, "diloco_syncer_takeovers_total") == 1
        assert metric(c, other, "diloco_syncer_leader") == 1
        assert metric(c, other, "diloco_syncer_lease_epoch") == epoch + 1
        assert figures["first_merge_seconds"] < TARGET_SECONDS, figures
        print(f"\nstandby takeover: {figures}")
        record("syncer SIGKILL, standby takes over from S3", **figures)
        stand_by(c, active)  # the killed one comes back as the standby of the new active

    def test_frozen_active_is_fenced(self, standby_job: Cluster) -> None:
        c = standby_job
        active, other, epoch = lease_holder(c)
        stand_by(c, other)
        c.wait_steps("local-0", 10, after=time.time())
        held = held_versions(c)
        old_incarnation = serving(c, active, epoch).incarnation  # type: ignore[union-attr]
        t_stop = c.kill(active, signal.SIGSTOP)
        held = {n: (c.last(n, "progress") or {}).get("versions", held[n]) for n in c.learners}
        # The standby takes over after the lease period; continue the frozen one at once, while
        # learners still hold its streams (their keepalive would notice only after ~15 s).
        c.wait_for(lambda: serving(c, other, epoch + 1), 60, f"{other} to take over at epoch {epoch + 1}")
        t_cont = c.kill(active, signal.SIGCONT)
        exit_code = c.wait_for(lambda: c.procs[active].popen.poll() is not None and  # type: ignore[union-attr]
                               (c.procs[active].popen.returncode, ), 30, f"the fenced {active} to exit")[0]  # type: ignore[union-attr]
        log = c.log(active).rsplit("=== ", 1)[-1]
        assert exit_code == 1 and "lost the syncer lease" in log, log[-3000:]
        after_resume = log[log.index("lost the syncer lease"):]
        assert "checkpoint ckpt-" not in after_resume  # it wrote nothing to the store once fenced
        withheld = int(after_resume.split("withheld ", 1)[1].split()[0])  # its gate's refusals after resuming
        figures = self.takeover(c, active, other, epoch + 1, t_stop, held)
        # Nothing the learners took came from the fenced syncer after the takeover: every join
        # since is the new epoch's, and no learner's versions went back.
        joins = c.select(after=t_cont, where=lambda e: e["event"] in ("joined", "rejoined") and "incarnation" in e)
        assert all(e["incarnation"] != old_incarnation for e in joins), joins
        versions_never_went_back(c, t_stop)
        record("syncer SIGSTOP, fenced after the takeover", frozen_seconds=round(t_cont - t_stop, 2),
               fenced_exit_code=exit_code, joins_to_the_fenced_syncer=0, withheld_by_the_fence=withheld,
               **figures)
        print(f"\nfenced: {figures}, withheld {withheld}")
