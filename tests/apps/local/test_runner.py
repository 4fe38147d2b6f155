"""Where `diloco run` puts its learners' processes (apps/local/runner.py `core_plan`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diloco.apps.local import runner
from diloco.apps.local.runner import LocalRun, core_plan
from diloco.spec import parse_job


def test_few_cores_are_taken_in_turn_without_host_cores() -> None:
    """Two cores, three learners and a syncer (this machine's `make run`): as before, no split."""
    assert core_plan([0, 1], [1, 1, 1], 1) == [[("0", None)], [("1", None)], [("0", None)]]


def test_cores_to_spare_give_every_learner_process_a_host_core() -> None:
    assert core_plan(list(range(8)), [1, 1, 1], 1) == [[("0", "3")], [("1", "4")], [("2", "5")]]
    # A multi-host learner: each of its processes a device core and a host core of its own.
    assert core_plan([4, 5, 6, 7, 8, 9, 10, 11], [2, 1], 2) == [[("4", "7"), ("5", "8")], [("6", "9")]]


def test_no_host_cores_unless_a_core_is_left_for_every_syncer_shard() -> None:
    assert core_plan(list(range(6)), [1, 1, 1], 1) == [[("0", None)], [("1", None)], [("2", None)]]
    assert core_plan(list(range(7)), [1, 1, 1], 2) == [[("0", None)], [("1", None)], [("2", None)]]
    assert core_plan(list(range(7)), [1, 1, 1], 1)[2] == [("2", "5")]


@pytest.mark.parametrize(("cores", "expect"), [(2, None), (16, "2")])
def test_the_runner_passes_the_plan_to_each_learner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    cores: int, expect: str | None) -> None:
    monkeypatch.setattr(runner.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    job = parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "j"},
                     "spec": {"learnerGroups": [{"name": "a", "replicas": 2}]}})
    run = LocalRun(job, tmp_path, None)
    try:
        argv = run.sup.children["a-0"].argv
        assert argv[argv.index("--cpus") + 1] == "0"
        assert (argv[argv.index("--host-cpus") + 1] if "--host-cpus" in argv else None) == expect
    finally:
        run.events.close()
        for channel in run.channels:
            channel.close()
