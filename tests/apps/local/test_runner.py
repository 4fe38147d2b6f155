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


class Exited:
    """A finished process as `Child` sees one."""

    def __init__(self, code: int) -> None:
        self.code, self.pid = code, 0

    def poll(self) -> int:
        return self.code


def test_a_run_ends_on_the_line_its_learner_ended_on(tmp_path: Path) -> None:
    """A learner that exits 2 ends the run with its fatal event's reason (bad data met mid-run),
    else its log's last line (refused at start-up, on stderr), and `diloco run` exits 2, not 1."""
    job = parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "j"},
                     "spec": {"learnerGroups": [{"name": "a", "replicas": 2}]}})
    run = LocalRun(job, tmp_path, None)
    try:
        fatal = "spec.data.source.path: x.parquet row group 5 cannot be read (bad); the file is corrupt: remove or rewrite it"
        run.record({"t": 1.0, "event": "fatal", "source": "a-1", "reason": fatal})
        run.sup.children["a-1"].proc = Exited(2)  # type: ignore[assignment]
        assert run._detect_crashes(2.0) == f"a-1 exited with code 2: {fatal} (log: {tmp_path / 'logs' / 'a-1.log'})"
        assert run.failure_code == 2
        (tmp_path / "logs" / "a-0.log").write_text("a warning\nspec.data.source: a.txt is not UTF-8 text (byte 5 is 0xe8); ...\n\n")
        run.sup.children["a-1"].proc = None
        run.sup.children["a-0"].proc = Exited(2)  # type: ignore[assignment]
        assert run._detect_crashes(3.0) == ("a-0 exited with code 2: spec.data.source: a.txt is not UTF-8 text (byte 5 is "
                                            f"0xe8); ... (log: {tmp_path / 'logs' / 'a-0.log'})")
    finally:
        run.events.close()
        for channel in run.channels:
            channel.close()
