"""bench/plan_wan.py's arithmetic: the links it shapes are the plan's own figures, scaled.

The bench itself needs root and network namespaces (docs/PLANNING.md has its run); what is
checked here is that the rates it shapes come from `diloco plan`'s model, not a copy of it.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import plan_wan


@pytest.fixture(scope="module")
def plan() -> dict[str, Any]:
    return plan_wan.plan_of(plan_wan.PLAN_12B_ONE_SHARD)


def test_its_default_plan_is_the_12b_plan_on_the_one_shard_it_runs(plan: dict[str, Any]) -> None:
    """The bench runs one syncer shard; the 12B x 4 plan keeps 4 at P = 48 (issue 63), and at
    P = 192 it is the one-shard plan docs/PLANNING.md's WAN rows measured (0.297 Gbit/s a region)."""
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
