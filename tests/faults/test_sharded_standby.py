"""A sharded syncer with a standby per shard (spec.syncer.shards 2, spec.syncer.standby).

One small job as real processes on 127.0.0.1 (tests/faults/cluster.py): each of the two shards
runs an active syncer and its standby (`--shard i`), all four sharing one S3 bucket served by
moto (tests/s3_server.py), each shard with its own prefix and lease (`<url>/shard-<i>`); two
learners given each shard's pair (`a0|b0,a1|b1`), as the operator's per-shard Services give
them one address a shard that follows the lease holder. Shard 1's active syncer is SIGKILLed:
its standby takes over from the bucket, learners hand back what its checkpoint missed and
re-join it, shard 0 never notices, and both learners keep pushing to both shards. The fault
suite's measures apply (versions never go back, no merge a learner had received is lost), and
the operator's view of the two shards (operator/syncer_client.py, operator/status/job.py)
names each shard's holder and counts the one takeover.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from diloco.contract import incarnation_epoch
from diloco.core.fragments import owner
from diloco.operator.status import job as st
from diloco.operator.syncer_client import SyncerClients, Target
from tests.faults.cluster import Cluster, Status
from tests.faults.test_faults import assert_versions_monotonic, metric, record, report_figures  # noqa: F401
from tests.faults.test_standby import held_versions, serving, versions_never_went_back
from tests.s3_server import s3_bucket

pytestmark = pytest.mark.e2e
LEASE_SECONDS = 4.0
TARGET_SECONDS = 15.0  # issue 62: kill to the standby's first merge
SHARDS = 2
STANDBYS = ("syncer-b", "syncer-1-b")


def contributions(s: Status, learner: str) -> float:
    return s.learners.get(learner, {}).get("contributions", 0)


@pytest.mark.timeout(420)
def test_a_shards_standby_takes_over_and_learners_push_to_both_shards(tmp_path: Path) -> None:
    with s3_bucket("sharded-standby") as bucket:
        syncer = {"fragments": 2, "shards": SHARDS, "checkpointIntervalSeconds": 1.0,
                  "checkpoints": {"url": bucket.url}, "standby": {"leaseSeconds": LEASE_SECONDS}}
        with Cluster(tmp_path, "faults-sharded-standby", 2, syncer=syncer, checkpoint_dir=bucket.url,
                     syncers=2) as c:
            assert c.syncer_shard == {"syncer": 0, "syncer-b": 0, "syncer-1": 1, "syncer-1-b": 1}
            c.start_syncer(name="syncer")  # each shard's first finds no lease and holds epoch 1
            c.start_syncer(name="syncer-1")
            for name in STANDBYS:
                c.start_syncer(name=name, wait=False)
            for name in STANDBYS:
                c.wait_for(lambda name=name: "standby:" in c.log(name), 60, f"{name} to stand by")  # type: ignore[misc]
            for i in range(2):
                c.start_learner(i)
            for name in c.learners:
                c.wait_event(name, "joined", timeout=150)

            def merging(name: str, steps: int) -> Status | None:
                s = serving(c, name, 1)
                return s if s is not None and s.outer_steps >= steps and s.checkpoint_version > 0 else None

            c.wait_for(lambda: merging("syncer", 20) and merging("syncer-1", 20)
                       and all(c.last(n, "progress") for n in c.learners), 120,
                       "20 merges and a checkpoint on each shard, progress from each learner")
            shard0 = serving(c, "syncer", 1)
            assert shard0 is not None
            c.wait_steps("local-0", 10, after=time.time())
            held = held_versions(c)
            t_kill = c.kill("syncer-1")  # SIGKILL: nothing of it survives but the bucket
            held = {n: (c.last(n, "progress") or {}).get("versions", held[n]) for n in c.learners}

            first = c.wait_for(lambda: serving(c, "syncer-1-b", 2), 60, "syncer-1-b to take over shard 1 at epoch 2")
            merged = c.wait_for(lambda: (s := serving(c, "syncer-1-b", 2)) and s.outer_steps > first.outer_steps and s,
                                30, "the first merge published by shard 1's standby")
            for n in c.learners:
                c.wait_event(n, "rejoined", after=t_kill, timeout=60,
                             where=lambda e: e.get("incarnation") == first.incarnation)
            settled = c.wait_for(lambda: (s := serving(c, "syncer-1-b", 2)) and s.active_learners == 2 and s, 30,
                                 "both learners subscribed to shard 1's new syncer")
            # Every merge of shard 1's fragments a learner had received survives the takeover.
            mine = [p for p in range(len(settled.versions)) if owner(p, SHARDS) == 1]
            newest_held = {p: max(v[p] for v in held.values() if v) for p in mine}
            lost = sum(max(0, newest_held[p] - settled.versions[p]) for p in mine)
            assert lost == 0, (settled.versions, held)

            # Both learners keep pushing to both shards: shard 0's syncer, which never changed, and
            # shard 1's new one merge on, each counting new contributions from each learner.
            zero = serving(c, "syncer", 1)
            assert zero is not None and zero.incarnation == shard0.incarnation

            def both_go_on() -> bool:
                s0, s1 = serving(c, "syncer", 1), serving(c, "syncer-1-b", 2)
                return bool(s0 and s1 and s0.outer_steps >= zero.outer_steps + 20
                            and s1.outer_steps >= settled.outer_steps + 20
                            and all(contributions(s0, n) > contributions(zero, n) and
                                    contributions(s1, n) > contributions(settled, n) for n in c.learners))

            c.wait_for(both_go_on, 90, "merges from both learners on both shards after the takeover")
            assert c.procs["syncer"].alive and serving(c, "syncer", 1).incarnation == shard0.incarnation  # type: ignore[union-attr]
            assert "holding the syncer lease" not in c.log("syncer-b")  # shard 0's standby still stands by
            assert_versions_monotonic(c)
            versions_never_went_back(c, t_kill)
            assert metric(c, "syncer-1-b", "diloco_syncer_takeovers_total") == 1
            assert metric(c, "syncer-1-b", "diloco_syncer_lease_epoch") == 2

            # The operator's view: one Status RPC a shard (each shard's Service reaches its lease
            # holder; here, its port), joined into one incarnation that names both holders.
            clients = SyncerClients()
            try:
                view, error = clients.status("ns", "j", Target(
                    f"127.0.0.1:{c.syncer_ports['syncer']},127.0.0.1:{c.syncer_ports['syncer-1-b']}", c.token))
            finally:
                clients.close()
            assert view is not None, error
            before = {"active": "h,h", "leaseEpoch": 2, "leaseEpochs": [1, 1], "takeovers": 0}
            active = st.active_syncer(before, view.incarnation)
            assert (active["leaseEpochs"], active["leaseEpoch"], active["takeovers"]) == ([1, 2], 3, 1)
            assert len(active["active"].split(",")) == SHARDS and all(active["active"].split(","))
            assert [incarnation_epoch(x) for x in view.incarnation.split("+")] == [1, 2]

            figures = {"serving_seconds": round(first.t - t_kill, 2), "first_merge_seconds": round(merged.t - t_kill, 2),
                       "merges_lost": lost, "fragments_recovered_from_learners": sum(
                           len(e["fragments"]) for e in c.select(kind="recovered", after=t_kill))}
            assert figures["first_merge_seconds"] < TARGET_SECONDS, figures
            print(f"\nsharded standby takeover (shard 1 of 2): {figures}")
            record("shard 1's syncer SIGKILL, its standby takes over from S3", **figures)
