"""The goodput simulator reproduces the paper's table with its defaults, and is a model, not a lookup."""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from diloco.apps.sim import cli
from diloco.apps.sim.goodput import (
    DAY,
    PAPER_GOODPUT,
    Interruptions,
    Row,
    SimParams,
    sample_interruptions,
    simulate_decoupled,
    simulate_dp,
    simulate_elastic,
    spare_slices,
    sweep,
)

P = SimParams()


def by_key(rows: list[Row]) -> dict[tuple[str, int, int | None], Row]:
    return {(r.system, r.chips, r.learners): r for r in rows}


@pytest.fixture(scope="module")
def paper_rows() -> dict[tuple[str, int, int | None], Row]:
    """The paper's configuration: 30-day runs, three seeds, defaults only."""
    return by_key(sweep([150_000, 2_400_000], [4, 8, 16], seeds=3, days=30, params=P))


@pytest.mark.parametrize("key", sorted(PAPER_GOODPUT, key=str))
@pytest.mark.slow
def test_defaults_reproduce_every_paper_entry(paper_rows, key) -> None:
    assert abs(paper_rows[key].goodput - PAPER_GOODPUT[key]) <= 0.05, paper_rows[key]


@pytest.mark.parametrize("chips", [150_000, 2_400_000])
@pytest.mark.parametrize("learners", [4, 8, 16])
def test_uptime_is_100_percent_for_four_or_more_learners(paper_rows, chips, learners) -> None:
    assert round(100 * paper_rows[("decoupled", chips, learners)].uptime) == 100


def test_failures_stall_the_coupled_systems(paper_rows) -> None:
    assert paper_rows[("dp", 2_400_000, None)].uptime < 0.5
    assert paper_rows[("elastic_dp", 2_400_000, None)].uptime < 0.5


@pytest.mark.slow
def test_goodput_falls_smoothly_at_unlisted_chip_counts() -> None:
    chips = [200_000, 350_000, 700_000, 1_000_000, 1_700_000, 2_000_000]
    rows = by_key(sweep(chips, [3, 12], seeds=1, days=10, params=P))
    for system, m in [("dp", None), ("elastic_dp", None), ("decoupled", 3), ("decoupled", 12)]:
        curve = np.array([rows[(system, c, m)].goodput for c in chips])
        assert np.all(np.diff(curve) < 0), (system, m, curve)
        # smooth: against log(chips) the slope changes little between neighbouring segments
        slopes = np.diff(curve) / np.diff(np.log(chips))
        assert np.all(np.abs(np.diff(slopes)) < 0.1), (system, m, slopes)


def test_goodput_rises_with_unlisted_learner_counts() -> None:
    ms = [3, 5, 6, 12, 24]
    rows = by_key(sweep([1_000_000], ms, seeds=1, days=10, params=P))
    curve = [rows[("decoupled", 1_000_000, m)].goodput for m in ms]
    assert all(a < b for a, b in itertools.pairwise(curve)), curve
    assert curve[0] > rows[("elastic_dp", 1_000_000, None)].goodput > rows[("dp", 1_000_000, None)].goodput


def test_m_learners_match_one_elastic_job_of_n_over_m_chips() -> None:
    """The paper's rule of thumb falls out of the model rather than being put in."""
    big = by_key(sweep([1_600_000], [8], seeds=2, days=10, params=P, systems=("decoupled",)))
    small = by_key(sweep([200_000], [], seeds=2, days=10, params=P, systems=("elastic_dp",)))
    assert big[("decoupled", 1_600_000, 8)].goodput == pytest.approx(
        small[("elastic_dp", 200_000, None)].goodput, abs=0.01)


def closed_form(system: str, chips: int, learners: int, p: SimParams) -> float:
    """First-order renewal formulas of docs/simulator.md (no overlap between rare events)."""
    rate = chips / p.mtbi_s
    n = round(chips / p.chips_per_slice)
    if system == "dp":
        job = 1 - spare_slices(chips, p) / n
        u = rate * job * p.checkpoint_interval_s
        kept = u * np.exp(-u) / (1 - np.exp(-u))  # progress kept up to the last checkpoint
        return job * kept / (1 + rate * job * (p.detection_s + p.restart_s))
    out = p.chips_per_slice * p.repair_s / p.mtbi_s
    out /= 1 + out  # fraction of slices in repair
    return (1 - out) / (1 + rate / learners * (1 - out) * (p.detection_s + p.reconfiguration_s))


@pytest.mark.parametrize("system, learners", [("dp", 1), ("elastic_dp", 1), ("decoupled", 2),
                                              ("decoupled", 8)])
def test_simulation_agrees_with_the_closed_form(system, learners) -> None:
    """The event code implements the documented model: within a point of its formula."""
    chips = 800_000
    row = by_key(sweep([chips], [learners], seeds=1, days=10, params=P, systems=(system,)))
    got = row[(system, chips, learners if system == "decoupled" else None)].goodput
    assert got == pytest.approx(closed_form(system, chips, learners, P), abs=0.01)


def test_one_learner_is_exactly_elastic_dp() -> None:
    ev = sample_interruptions(300_000, 5, P, np.random.default_rng(1))
    assert simulate_decoupled(ev, 1, P) == simulate_elastic(ev, P)


def test_same_seed_same_rows_and_different_seeds_differ() -> None:
    a = sweep([100_000], [4], seeds=2, days=3, params=P)
    assert a == sweep([100_000], [4], seeds=2, days=3, params=P)
    one = sample_interruptions(100_000, 3, P, np.random.default_rng([0, 100_000]))
    two = sample_interruptions(100_000, 3, P, np.random.default_rng([1, 100_000]))
    assert one.times.size != two.times.size or not np.array_equal(one.times, two.times)


def test_interruption_count_follows_chips_over_mtbi() -> None:
    ev = sample_interruptions(2_400_000, 30, P, np.random.default_rng(0))
    expected = 2_400_000 * 30 / 365.25
    assert abs(ev.times.size - expected) < 5 * np.sqrt(expected)
    assert np.all(np.diff(ev.times) >= 0) and ev.slices.max() < ev.n_slices


def test_no_failures_means_full_goodput_except_dp_spares() -> None:
    calm = replace(P, mtbi_s=1e12)
    ev = sample_interruptions(100_000, 2, calm, np.random.default_rng(0))
    assert ev.times.size == 0
    assert simulate_elastic(ev, calm).goodput == 1.0
    assert simulate_decoupled(ev, 8, calm).uptime == 1.0
    dp = simulate_dp(ev, calm)
    assert dp.uptime == 1.0
    assert dp.goodput == pytest.approx(1.0 - spare_slices(100_000, calm) / ev.n_slices)


def events(times: list[float], slices: list[int], n_slices: int, horizon: float) -> Interruptions:
    return Interruptions(n_slices * 256, n_slices, horizon, np.array(times), np.array(slices))


def test_dp_one_failure_by_hand() -> None:
    p = replace(P, repair_s=1.0, spare_sigma=0.0)  # tiny repair: exactly one spare slice
    ev = events([1003.0], [5], n_slices=10, horizon=10_000.0)
    assert spare_slices(ev.chips, p) == 1
    out = simulate_dp(ev, p)
    resume = 1003.0 + p.detection_s + p.restart_s
    progress = 1000.0 + (10_000.0 - resume)  # the 3 s since the last checkpoint are lost
    assert out.goodput == pytest.approx(progress * 0.9 / 10_000.0)
    assert out.uptime == pytest.approx(1 - (resume - 1003.0) / 10_000.0)


def test_dp_waits_when_spares_run_out() -> None:
    p = replace(P, repair_s=500.0, spare_sigma=0.0)
    ev = events([100.0, 100.5], [0, 5], n_slices=10, horizon=10_000.0)  # a spare and a job slice
    assert spare_slices(ev.chips, p) == 1  # so at the restart two slices are in repair
    out = simulate_dp(ev, p)
    resume = 100.0 + 500.0 + p.restart_s  # the first repair frees a spare
    assert out.uptime == pytest.approx(1 - (resume - 100.5) / 10_000.0)


def test_elastic_pause_repair_and_forced_rejoin_by_hand() -> None:
    p = replace(P, repair_s=1000.0, rejoin_wait_s=100.0)
    ev = events([50.0], [0], n_slices=4, horizon=5000.0)
    out = simulate_elastic(ev, p)
    stop = p.detection_s + p.reconfiguration_s
    rejoin = 50.0 + 1000.0 + 100.0  # nobody else failed, so the slice forces a reconfiguration
    useful = 4 * 50.0 + 3 * (rejoin - 50.0 - stop) + 4 * (5000.0 - rejoin - p.reconfiguration_s)
    assert out.goodput == pytest.approx(useful / (4 * 5000.0))
    assert out.uptime == pytest.approx(1 - (stop + p.reconfiguration_s) / 5000.0)


def test_learner_that_loses_every_slice_is_readmitted_after_state_pull() -> None:
    p = replace(P, repair_s=1000.0)
    ev = events([50.0, 60.0], [0, 1], n_slices=2, horizon=5000.0)  # learner 0: one slice
    out = simulate_decoupled(ev, 2, p)
    back = 50.0 + 1000.0 + p.reconfiguration_s + p.state_pull_s
    useful = 50.0 + (5000.0 - back) + 60.0 + (5000.0 - (60.0 + 1000.0 + p.reconfiguration_s
                                                        + p.state_pull_s))
    assert out.goodput == pytest.approx(useful / (2 * 5000.0))
    assert out.uptime == pytest.approx(1 - (back - 60.0) / 5000.0)  # both down from 60 s on


def test_quorum_above_one_lowers_uptime_only() -> None:
    ev = sample_interruptions(600_000, 5, P, np.random.default_rng(3))
    k1, k3 = simulate_decoupled(ev, 4, P), simulate_decoupled(ev, 4, replace(P, quorum=3))
    assert k3.goodput == k1.goodput and k3.uptime < k1.uptime


def test_slower_recovery_costs_goodput() -> None:
    ev = sample_interruptions(600_000, 5, P, np.random.default_rng(4))
    assert simulate_dp(ev, replace(P, restart_s=120.0)).goodput < simulate_dp(ev, P).goodput
    assert simulate_dp(ev, replace(P, checkpoint_interval_s=60.0)).goodput < simulate_dp(ev, P).goodput
    assert simulate_elastic(ev, replace(P, repair_s=10 * 3600.0)).goodput < simulate_elastic(ev, P).goodput
    slow = replace(P, reconfiguration_s=30.0)
    assert simulate_decoupled(ev, 8, slow).goodput < simulate_decoupled(ev, 8, P).goodput


@settings(max_examples=40, deadline=None)
@given(chips=st.integers(256, 20_000), days=st.floats(0.2, 3.0), learners=st.integers(1, 8),
       mtbi_days=st.floats(5.0, 400.0), repair_h=st.floats(0.0, 48.0), seed=st.integers(0, 99))
def test_outcomes_are_fractions_and_goodput_never_exceeds_uptime(chips, days, learners, mtbi_days,
                                                                  repair_h, seed) -> None:
    p = replace(P, mtbi_s=mtbi_days * DAY, repair_s=repair_h * 3600.0)
    ev = sample_interruptions(chips, days, p, np.random.default_rng(seed))
    for out in (simulate_dp(ev, p), simulate_elastic(ev, p)):
        assert 0.0 <= out.goodput <= out.uptime + 1e-9 <= 1.0 + 1e-9
    if learners <= ev.n_slices:
        out = simulate_decoupled(ev, learners, p)
        assert 0.0 <= out.goodput <= 1.0 and 0.0 <= out.uptime <= 1.0


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser(prog="diloco")
    sub = parser.add_subparsers(required=True)
    cli.add_simulate_parser(sub)
    try:
        args = parser.parse_args(argv)
        code = args.func(args)
    except SystemExit as exc:
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.slow
def test_cli_json_rows_and_plot(tmp_path: Path, capsys) -> None:
    png = tmp_path / "g.png"
    code, out, _err = run_cli(["simulate", "--chips", "20K,40000", "--learners", "2,4", "--seeds", "1",
                              "--days", "1", "--json", "--plot", str(png)], capsys)
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and len(rows) == 2 * 4 and png.stat().st_size > 10_000
    for row in rows:
        assert {"system", "chips", "learners", "goodput", "uptime"} <= row.keys()
        assert 0 <= row["goodput"] <= 1 and 0 <= row["uptime"] <= 1
        assert (row["learners"] is None) == (row["system"] != "decoupled")


def test_cli_prints_a_table_and_writes_no_file_unless_asked(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    code, out, _ = run_cli(["simulate", "--chips", "20000", "--learners", "2", "--seeds", "1",
                            "--days", "1", "--restart-s", "90"], capsys)
    assert code == 0 and "elastic_dp" in out and not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, option", [
    (["--chips", "-150000"], "--chips"),
    (["--chips", "1.5"], "--chips"),
    (["--systems", "dp,spmd"], "--systems"),
    (["--chips", "2000", "--learners", "16"], "--learners"),
    (["--learners", "2", "--quorum", "3"], "--quorum"),
    (["--detection-s", "-1"], "--detection-s"),
    (["--mtbi-days", "0"], "--mtbi-days"),
    (["--seeds", "0"], "--seeds"),
])
def test_cli_rejects_bad_options_naming_them(argv, option, capsys) -> None:
    code, _, err = run_cli(["simulate", "--days", "0.1", *argv], capsys)
    assert code == 2 and option in err


def test_cli_import_does_not_load_matplotlib() -> None:
    probe = "import sys, diloco.apps.sim.cli; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("field, value", [("mtbi_s", 0.0), ("chips_per_slice", 0), ("quorum", 0),
                                          ("restart_s", -1.0), ("checkpoint_interval_s", 0.0),
                                          ("repair_s", float("inf"))])
def test_invalid_params_are_named(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        sweep([10_000], [2], seeds=1, days=0.1, params=replace(P, **{field: value}))
