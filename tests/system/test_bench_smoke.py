"""Every side-by-side benchmark runs end to end in its cheapest mode and ends with its JSON line.

The scripts run one after another (each `--smoke`: a tiny model, seconds per phase): run at
once on two cores they starve each other, and a figure that needs an event (a newcomer's join)
can then miss its window. The figures' values are not compared with
targets (on a smoke budget they mean nothing; docs/BENCHMARKS.md has the real runs), but every
number a script reports must be finite: a NaN ratio is a broken benchmark.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

EXPECTED = {
    "quality.py": {"bench", "decoupled_over_dp", "decoupled_over_sync", "chaos_over_dp", "seeds", "std"},
    "replay.py": {"bench", "arms", "seeds"},
    "bandwidth_measured.py": {"bench", "ratio", "ratio_down", "rows"},
    "heterogeneous.py": {"bench", "decoupled_ratio", "sync_diloco_ratio", "uncoupled_tokens_per_s",
                         "decoupled_tokens_per_s", "sync_diloco_tokens_per_s"},
    "scavenging.py": {"bench", "tokens_per_s_before", "tokens_per_s_after", "fraction_of_ideal",
                      "loss_before_join", "max_loss_after_join", "spike"},
    "syncer_scale.py": {"bench", "max_learners", "shard_speedup", "trials"},
    "push_rpc.py": {"bench", "stream_cpu_ms", "unary_cpu_ms", "stream_over_unary_cpu"},
    "multihost_push.py": {"bench", "gather_ms", "gather_once_ms", "per_host_ms", "gather_over_per_host"},
    "multihost_share.py": {"bench", "median_ms", "pickle_over_typed_none", "pickle_over_typed_fragment"},
    "xla_cpu.py": {"bench", "median_ms", "first_step_cpu_ratio", "restart_cpu_ratio", "steady_step_ratio"},
}


def numbers(value: object) -> list[float]:
    """Every number in a JSON value, nested lists and objects included."""
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [float(value)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in numbers(v)]
    if isinstance(value, list):
        return [x for v in value for x in numbers(v)]
    return []


@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_every_bench_script_smoke_runs_and_ends_with_json() -> None:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    failures = []
    for name, keys in EXPECTED.items():
        try:
            done = subprocess.run([sys.executable, str(ROOT / "bench" / name), "--smoke"], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=150)
        except subprocess.TimeoutExpired as exc:
            failures.append(f"{name}: timed out\n{(exc.stderr or b'')[-2000:]!r}")
            continue
        if done.returncode != 0:
            failures.append(f"{name}: exit {done.returncode}\n{done.stderr[-3000:]}")
            continue
        last = done.stdout.strip().splitlines()[-1]
        result = json.loads(last)
        missing = keys - set(result)
        if missing:
            failures.append(f"{name}: last line lacks {sorted(missing)}: {last[:500]}")
        if name == "syncer_scale.py":  # its smoke makes one whole Join beside every trial's pushes
            rows = [row for trials in result["trials"].values() for rs in trials["rows"].values() for row in rs]
            if not rows or any(len(row.get("joins", [])) != 1 for row in rows):
                failures.append(f"{name}: a trial without its one whole Join: {rows}")
        if not all(math.isfinite(x) for x in numbers(result)):
            failures.append(f"{name}: a reported figure is not finite: {last[:500]}")
    assert not failures, "\n\n".join(failures)


@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_the_accelerator_check_runs_dry_on_the_cpu() -> None:
    """bench/accelerator.sh, unchanged, in its CPU mode: the command the first accelerator runs."""
    env = dict(os.environ, PYTHON=sys.executable, PYTHONUNBUFFERED="1")
    done = subprocess.run(["bash", str(ROOT / "bench" / "accelerator.sh"), "--dry-run"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=380)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["bench"] == "accelerator" and result["dry_run"] is True
    tiny = result["llama-tiny"]
    assert {"ratio", "mfu", "peak_source", "host_core", "one_core"} <= set(tiny)
    assert all(math.isfinite(x) for x in numbers(result)) and tiny["ratio"] > 0
