"""bench/plan_wan.py's arithmetic: the links it shapes are the plan's own figures, scaled.

The bench itself needs root and network namespaces (docs/PLANNING.md has its run); what is
checked here is that the rates it shapes come from `diloco plan`'s model, not a copy of it, and
which processes it starts for a sharded plan (one syncer process a shard, learners given every shard).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import plan_wan


@pytest.fixture(scope="module")
def plan() -> dict[str, Any]:
    return plan_wan.plan_of(plan_wan.PLAN_12B_ONE_SHARD)


def test_its_default_plan_is_the_12b_plan_on_one_shard(plan: dict[str, Any]) -> None:
    """The 12B x 4 plan keeps 4 shards at P = 48 (issue 63); the bench's default is the same plan at
    P = 192, the one-shard plan docs/PLANNING.md's WAN rows measured (0.297 Gbit/s a region)."""
    assert (plan["fragments"], plan["shards"], [r["learners"] for r in plan["regions"]]) == (192, 1, [1, 1, 1, 1])
    for r in plan["regions"]:
        assert r["up_bytes_per_s"] * 8 / 1e9 == pytest.approx(0.297, abs=0.001)


def test_rates_at_the_planned_size_are_the_plans(plan: dict[str, Any]) -> None:
    """Unscaled (the plan's parameters and step), the bench's bytes/s are the plan's own."""
    got = plan_wan.rates(plan, plan["params"], plan["step_s"], 0.8)
    for r in plan["regions"]:
        row = got[r["name"]]
        assert row["up_bytes_per_s"] == pytest.approx(r["up_bytes_per_s"], rel=1e-6)
        assert row["down_bytes_per_s"] == pytest.approx(r["down_bytes_per_s"], rel=1e-6)
        assert row["given_mbit"] == pytest.approx(r["link_bytes_per_s"] * 8 / 1e6, rel=1e-6)
        assert row["planned_mbit"] == pytest.approx(r["down_bytes_per_s"] / 0.8 * 8 / 1e6, rel=1e-6)


def test_rates_scale_with_the_model_and_the_steps_per_second(plan: dict[str, Any]) -> None:
    full = plan_wan.rates(plan, plan["params"], 1.0, 0.8)["us-east"]["planned_mbit"]
    scaled = plan_wan.rates(plan, plan["params"] / 1000, 2.0, 0.8)["us-east"]["planned_mbit"]
    assert scaled == pytest.approx(full / 2000, rel=1e-9)


def test_the_plans_headroom_is_read_from_its_own_flags() -> None:
    assert plan_wan.link_share(plan_wan.PLAN_12B) == 0.8
    assert plan_wan.link_share(plan_wan.PLAN_12B + " --link-share 0.5") == 0.5


def test_with_link_changes_one_region_only() -> None:
    args = plan_wan.with_link(plan_wan.PLAN_12B, "us-east", 0.35)
    assert "name=us-east,chips=4096,wan-gbps=0.35,latency-ms=20" in args
    assert "name=us-central,chips=4096,wan-gbps=5," in args
    assert args.replace("wan-gbps=0.35", "wan-gbps=2") == plan_wan.PLAN_12B


@pytest.mark.parametrize(("name", "shards", "fragments"), [("12b", 4, 48), ("2e9-two-shards", 2, 24)])
def test_its_sharded_plans_keep_their_shards(name: str, shards: int, fragments: int) -> None:
    got = plan_wan.plan_of(plan_wan.PLANS[name])
    assert (got["shards"], got["fragments"]) == (shards, fragments)
    assert all(r["learners"] == 1 for r in got["regions"])  # the bench runs one learner a region


def test_a_sharded_plan_runs_a_syncer_process_a_shard_and_learners_reach_every_shard(tmp_path: Path) -> None:
    """The 12B x 4 plan's own topology: 4 `diloco syncer --shard i` on ports PORT + i, each with its
    own checkpoint directory; each learner's --syncer names all four from its region, in shard order;
    the job has the plan's P per shard and N, so the scaled GPT has P x N fragments."""
    plan = plan_wan.plan_of(plan_wan.PLAN_12B)
    n, config = plan["shards"], tmp_path / "job.yaml"
    syncers = [plan_wan.syncer_argv(config, tmp_path, i, n) for i in range(n)]
    for i, argv in enumerate(syncers):
        assert argv[argv.index("syncer") + 1:] == ["--config", str(config), "--port", str(plan_wan.PORT + i),
                                                   "--checkpoint-dir", str(tmp_path / "ckpt" / f"shard-{i}"),
                                                   "--shard", str(i)]
    learner = plan_wan.learner_argv(config, "us-east", 0, plan_wan.addresses("10.77.2.1", n), 1)
    assert learner[learner.index("--syncer") + 1] == "10.77.2.1:50200,10.77.2.1:50201,10.77.2.1:50202,10.77.2.1:50203"
    assert learner[learner.index("--cpus") + 1] == "1" and learner[learner.index("--group") + 1] == "us-east"
    spec = plan_wan.job(plan, 24, 128, 4.0)["spec"]
    assert (spec["syncer"]["fragments"], spec["syncer"]["shards"]) == (48, 4)
    assert [g["replicas"] for g in spec["learnerGroups"]] == [1, 1, 1, 1]


def test_one_shard_runs_as_before(tmp_path: Path, plan: dict[str, Any]) -> None:
    """Unsharded: one syncer process without --shard, learners given its one address."""
    argv = plan_wan.syncer_argv(tmp_path / "job.yaml", tmp_path, 0, 1)
    assert "--shard" not in argv and argv[argv.index("--port") + 1] == str(plan_wan.PORT)
    learner = plan_wan.learner_argv(tmp_path / "job.yaml", "us-west", 0, plan_wan.addresses("10.77.3.1", 1), 0)
    assert learner[learner.index("--syncer") + 1] == "10.77.3.1:50200"
    assert plan_wan.job(plan, 24, 128, 4.0)["spec"]["syncer"]["shards"] == 1


def test_a_sharded_plans_bytes_are_the_total_over_its_shards() -> None:
    """12B at P = 48 x 4 shards: a region carries 1/48 of the model a step (one fragment of 1/192 to
    each shard), four times the one-shard plan's 1/192: 1.19 Gbit/s each way against 0.297."""
    sharded, one = plan_wan.plan_of(plan_wan.PLAN_12B), plan_wan.plan_of(plan_wan.PLAN_12B_ONE_SHARD)
    a = plan_wan.rates(sharded, sharded["params"], 1.0, 0.8)["us-east"]
    b = plan_wan.rates(one, one["params"], 1.0, 0.8)["us-east"]
    assert a["up_bytes_per_s"] == pytest.approx(4 * b["up_bytes_per_s"], rel=1e-9)
    assert a["up_bytes_per_s"] * 8 / 1e9 == pytest.approx(1.186, abs=0.001)


class _Net:
    def __init__(self) -> None:
        self.links, self.rates = {"a": None, "b": None}, list[tuple[str, float | None]]()

    def set_rate(self, region: str, mbit: float) -> None:
        self.rates.append((region, mbit))

    def unshape(self, region: str) -> None:
        self.rates.append((region, None))


class _Learner:
    def __init__(self, step_s: float) -> None:
        now = time.time()
        self.events = [{"t": now - 8 + i * step_s, "step": i} for i in range(int(8 / step_s) + 1)]


def test_a_tracking_pacer_scales_the_links_to_the_fastest_learners_pace_now() -> None:
    """`--pace track`: links scaled at a 1 s pace, learners now at 0.5 s (and 0.8 s): twice the bytes."""
    net = _Net()
    pacer = plan_wan.Pacer(net, [_Learner(0.5), _Learner(0.8)], step=1.0, track=True, every=3600)  # type: ignore[list-item]
    pacer.set({"a": 1.0, "b": 2.0})
    assert net.rates == [("a", pytest.approx(2.0, rel=0.02)), ("b", pytest.approx(4.0, rel=0.02))]
    t = time.time()
    got = pacer.over(t - 0.001, t + 1)
    assert got["mbit"] == {"a": pytest.approx(2.0, rel=0.02), "b": pytest.approx(4.0, rel=0.02)}
    assert got["paced_step_s"][0] == pytest.approx(0.5, rel=0.02)
    pacer.set(None)
    assert net.rates[-2:] == [("a", None), ("b", None)]
    assert pacer.over(time.time(), time.time() + 1) == {}
    pacer.done.set()


def test_an_untracked_pacer_keeps_the_unthrottled_pace() -> None:
    net = _Net()
    pacer = plan_wan.Pacer(net, [_Learner(0.5)], step=1.0, track=False)  # type: ignore[list-item]
    pacer.set({"a": 1.0, "b": 2.0})
    assert net.rates == [("a", 1.0), ("b", 2.0)]
