"""Progress toward the job's bound and its ETA (operator/status/progress.py): pure tables, then
through `job.compute` pass after pass, each status merged as the API server merges the patch."""

from __future__ import annotations

from typing import Any

import pytest

from diloco.operator.status import conditions as c
from diloco.operator.status import job as st
from diloco.operator.status import progress
from diloco.spec import JobSpec, parse_job
from tests.operator.status.test_schema import check

T0 = 1_800_000_000.0


def spec(training: dict[str, Any] | None = None, **extra: Any) -> JobSpec:
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "j"},
                      "spec": {"learnerGroups": [{"name": "us", "replicas": 2}], "training": training or {},
                               **extra}}).spec


def view(outer: int = 0, tokens: int = 0, incarnation: str = "i1") -> st.SyncerView:
    return st.SyncerView(incarnation=incarnation, outer_version=outer, tokens_merged=tokens, active_learners=2,
                         readmissions=0)


def obs(now: float, syncer: st.SyncerView | None, **kw: Any) -> st.Observation:
    return st.Observation(now=now, ready={"us": 2}, syncer_endpoint="j-syncer:1", syncer_ready=True, syncer=syncer,
                          **kw)


def merged(old: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """The stored status after a merge patch of whole top-level fields (null deletes)."""
    out = {**old, **patch}
    return {k: v for k, v in out.items() if v is not None}


def passes(job: JobSpec, steps: list[tuple[float, st.SyncerView | None]], status: dict[str, Any] | None = None,
           **kw: Any) -> dict[str, Any]:
    """The stored status after one pass per (seconds after T0, the syncer's answer)."""
    s = status or {}
    for at, answer in steps:
        s = merged(s, st.changed(s, check(st.compute(job, s, obs(T0 + at, answer), generation=1, **kw))))
    return s


@pytest.mark.parametrize("seconds, shown", [
    (0, "0s"), (-5, "0s"), (45.9, "45s"), (60, "1m"), (200, "3m20s"), (599, "9m59s"), (600, "10m"), (3599, "59m"),
    (3600, "1h"), (7980, "2h13m"), (86399, "23h59m"), (86400, "1d"), (3 * 86400 + 4 * 3600, "3d4h"),
    (12 * 86400 + 4 * 3600, "12d"), (1000 * 86400, ">999d"),
])
def test_human_durations_fit_a_column(seconds: float, shown: str) -> None:
    assert progress.human(seconds) == shown


def test_no_bound_writes_nothing_and_a_removed_bound_clears_the_columns() -> None:
    s = passes(spec(), [(0, view(40, 1000)), (120, view(80, 2000))])
    assert not {"progress", "eta", "progressDetail"} & set(s)
    bounded = passes(spec({"tokenBudget": 10_000}), [(0, view(40, 1000)), (120, view(80, 2000))])
    assert bounded["progress"] == "20%" and bounded["eta"]
    cleared = passes(spec(), [(240, view(120, 3000))], bounded)
    assert not {"progress", "eta", "progressDetail"} & set(cleared)


def test_tokens_bound_and_its_rate_from_two_passes() -> None:
    job = spec({"tokenBudget": 1_000_000})
    first = passes(job, [(0, view(10, 100_000))])
    assert (first["progress"], first.get("eta")) == ("10%", None)  # one sample: no rate yet
    assert first["progressDetail"] == {"unit": "tokens", "done": 100_000, "bound": 1_000_000, "percent": 10.0,
                                       "rate": 0.0, "samples": [{"at": T0, "outerVersion": 10, "tokensMerged": 100_000}]}
    early = passes(job, [(30, view(12, 130_000))], first)
    assert early.get("eta") is None  # 30 s is too short a baseline
    s = passes(job, [(100, view(20, 200_000))], first)  # 1000 tokens/s, 800,000 left
    assert (s["progress"], s["eta"], s["progressDetail"]["rate"]) == ("20%", "13m", 1000.0)


def test_steps_bound_counts_merged_slots_per_shard() -> None:
    # Each slot closes one round per shard, one version each: outerVersion / shards slots merged.
    one = passes(spec({"steps": 1000}), [(0, view(outer=100)), (100, view(outer=200))])
    assert (one["progress"], one["progressDetail"]["done"], one["eta"]) == ("20%", 200, "13m")
    two = passes(spec({"steps": 1000}, syncer={"shards": 2}), [(0, view(outer=200)), (100, view(outer=400))])
    assert (two["progress"], two["progressDetail"]["done"], two["eta"]) == ("20%", 200, "13m")


def test_steps_estimate_at_the_bound_stays_short_of_done_until_every_learner_finished() -> None:
    job = spec({"steps": 100})
    s = passes(job, [(0, view(outer=90)), (100, view(outer=104))])
    assert (s["progress"], s["progressDetail"]["done"], s["progressDetail"]["percent"]) == ("99%", 100, 99.9)
    assert s["eta"] == "0s"
    everyone = ("us-0", "us-1")
    end = st.ending(job, s, obs(T0 + 110, view(outer=106), finished=everyone))
    assert end is not None and end.reason == "StepsReached"
    done = passes(job, [(110, view(outer=106))], s, ended=end)
    assert (done["phase"], done["progress"], done["progressDetail"]["done"], done["progressDetail"]["percent"]) == \
        ("Succeeded", "100%", 100, 100.0)
    assert "eta" not in done and done["progressDetail"]["samples"] == []


def test_token_budget_reached_is_100_percent_and_no_eta() -> None:
    job = spec({"tokenBudget": 5000})
    s = passes(job, [(0, view(10, 1000)), (100, view(20, 3000))])
    end = st.ending(job, s, obs(T0 + 200, view(30, 5200)))
    assert end is not None and end.succeeded
    done = passes(job, [(200, view(30, 5200))], s, ended=end)
    assert (done["progress"], done["progressDetail"]["done"]) == ("100%", 5200) and "eta" not in done
    later = passes(job, [(300, view(30, 5200)), (400, None)], done)  # the syncer answers on, then stops
    assert [later.get(k) for k in ("progress", "eta", "progressDetail")] == \
        [done.get(k) for k in ("progress", "eta", "progressDetail")]


def test_a_duration_bound_is_exact_and_stops_with_the_job() -> None:
    job = spec({"durationSeconds": 3600})
    s = passes(job, [(0, None), (900, None)])  # the syncer silent: the clock alone
    assert (s["progress"], s["eta"], s["progressDetail"]["unit"]) == ("25%", "45m", "seconds")
    end = st.ending(job, s, obs(T0 + 3600, view(10, 100)))
    assert end is not None and end.reason == "DurationReached"
    done = passes(job, [(3600, view(10, 100))], s, ended=end)
    assert (done["progress"], done["progressDetail"]["done"]) == ("100%", 3600) and "eta" not in done
    assert passes(job, [(4000, view(10, 100))], done)["progressDetail"] == done["progressDetail"]  # frozen


def test_several_bounds_show_the_one_expected_first() -> None:
    job = spec({"tokenBudget": 1_000_000, "durationSeconds": 7200})
    first = passes(job, [(0, view(0, 0))])
    assert first["progressDetail"]["unit"] == "seconds"  # the only one with a rate yet
    fast = passes(job, [(600, view(600, 600_000))], first)  # tokens: 400 s left; the clock: 6600 s
    assert (fast["progressDetail"]["unit"], fast["progress"], fast["eta"]) == ("tokens", "60%", "6m40s")
    slow = passes(job, [(600, view(60, 60_000))], first)
    assert (slow["progressDetail"]["unit"], slow["progress"], slow["eta"]) == ("seconds", "8%", "1h50m")


def test_a_silent_syncer_leaves_the_eta_unknown_and_keeps_the_memory() -> None:
    job = spec({"tokenBudget": 1_000_000})
    s = passes(job, [(0, view(0, 0)), (100, view(10, 100_000))])
    assert s["eta"] == "15m"
    silent = passes(job, [(200, None)], s)
    assert silent["progress"] == "10%" and "eta" not in silent and silent["progressDetail"]["rate"] == 0.0
    assert silent["progressDetail"]["samples"] == s["progressDetail"]["samples"]
    back = passes(job, [(300, view(30, 300_000))], silent)
    assert back["eta"] == "11m"  # 1000 tokens/s across the outage, 700,000 left


@pytest.mark.parametrize("after, why", [
    ((400, view(5, 40_000, incarnation="i2")), "a syncer restarted without its checkpoint: counters fell"),
    ((-50, view(30, 300_000)), "the clock went back"),
])
def test_a_counter_reset_or_a_clock_going_back_starts_the_rate_afresh(after: tuple[float, st.SyncerView],
                                                                       why: str) -> None:
    job = spec({"tokenBudget": 1_000_000})
    s = passes(job, [(0, view(0, 0)), (150, view(15, 150_000)), (300, view(30, 300_000))])
    assert len(s["progressDetail"]["samples"]) == 3 and s["eta"]
    reset = passes(job, [after], s)
    detail = reset["progressDetail"]
    assert "eta" not in reset and detail["rate"] == 0.0, why
    assert detail["samples"] == [{"at": round(T0 + after[0], 3), "outerVersion": after[1].outer_version,
                                  "tokensMerged": after[1].tokens_merged}], why
    assert 0 <= detail["percent"] < 100 and detail["done"] == after[1].tokens_merged
    again = passes(job, [(after[0] + 100, view(after[1].outer_version + 10, after[1].tokens_merged + 50_000))], reset)
    assert again["progressDetail"]["rate"] == 500.0 and again["eta"]


def test_the_rate_follows_the_last_ten_minutes_and_the_memory_stays_small() -> None:
    job = spec({"tokenBudget": 100_000_000})
    answers = [(t, view(t, 10 * t)) for t in range(0, 3600, 30)]  # 10 tokens/s for an hour
    answers += [(t, view(t, 36_000 + 100 * (t - 3600))) for t in range(3600, 4800, 30)]  # then 100 tokens/s
    s = passes(job, answers)
    detail = s["progressDetail"]
    assert 1 < len(detail["samples"]) <= 5
    assert progress.WINDOW <= T0 + 4770 - detail["samples"][0]["at"] < progress.WINDOW + progress.SPACING
    assert detail["rate"] == 100.0  # the old speed is out of the window


def test_suspended_and_failed_jobs_show_their_progress_without_an_eta() -> None:
    job = spec({"tokenBudget": 1_000_000})
    s = passes(job, [(0, view(0, 0)), (100, view(10, 100_000))])
    paused = passes(spec({"tokenBudget": 1_000_000}, suspend=True), [(200, view(20, 200_000))], s)
    assert (paused["phase"], paused["progress"]) == ("Suspended", "20%") and "eta" not in paused
    assert paused["progressDetail"]["samples"] == [] and paused["progressDetail"]["rate"] == 0.0
    resumed = passes(job, [(300, view(20, 200_000)), (400, view(30, 300_000))], paused)
    assert resumed["eta"] == "11m"  # measured from the resume, not across the pause
    failed = passes(job, [(500, view(40, 400_000))], resumed,
                    ended=st.Ending(False, "DeadlineExceeded", "ran too long"))
    assert (failed["phase"], failed["progress"]) == ("Failed", "40%") and "eta" not in failed
    assert c.is_true(failed["conditions"], c.FAILED)


def test_pick_and_toward_directly() -> None:
    toward = [progress.Toward("tokens", 10, 100, 0.0), progress.Toward("steps", 50, 100, 0.0)]
    assert progress.pick(toward, None).unit == "steps" and progress.pick(toward, "tokens").unit == "tokens"
    assert progress.Toward("steps", 120, 100, 2.0).eta == 0.0 and progress.Toward("steps", 1, 100, 0.0).eta is None
