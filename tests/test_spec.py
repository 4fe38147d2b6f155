"""The job spec: defaults, field-path errors, and `diloco validate`."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from diloco.spec import SpecError, dump_job, load_job, parse_job

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def minimal(**spec):
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "t"},
            "spec": {"learnerGroups": [{"name": "a", "replicas": 4}], **spec}}


def problems(manifest) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_job(manifest)
    return info.value.problems


def test_defaults_follow_the_paper() -> None:
    s = parse_job(minimal()).spec
    assert (s.syncer.quorum, s.syncer.grace_window.gamma, s.syncer.grace_window.tau) == (1, 0.8, 2)
    assert (s.syncer.outer_learning_rate, s.syncer.outer_momentum) == (0.7, 0.9)
    assert (s.syncer.compression, s.syncer.merge, s.syncer.fragmentation) == ("int4", "rda", "balanced")
    assert s.syncer.blend == 0.0 and s.learner_ids() == ["a-0", "a-1", "a-2", "a-3"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_and_round_trip(path: Path) -> None:
    job = load_job(str(path))
    assert parse_job(dump_job(job)) == job


def test_quorum_above_learners_names_field() -> None:
    assert problems(minimal(syncer={"quorum": 9})) == [
        "spec.syncer.quorum: 9 exceeds the 4 learners in spec.learnerGroups; lower the quorum or add replicas"
    ]


def test_every_problem_reported_with_its_path() -> None:
    m = minimal(syncer={"fragments": 0, "compression": "int2"}, model={"dModel": 100, "heads": 3})
    m["spec"]["learnerGroups"].append({"name": "B_bad", "replicas": -1, "colour": "red"})
    lines = problems(m)
    for fragment in ["spec.syncer.fragments:", "spec.syncer.compression:", "spec.model: dModel 100",
                     "spec.learnerGroups[1].name:", "spec.learnerGroups[1].replicas:",
                     "spec.learnerGroups[1].colour: unknown field"]:
        assert any(line.startswith(fragment) for line in lines), (fragment, lines)


def test_duplicate_group_and_wrong_kind() -> None:
    m = minimal()
    m["spec"]["learnerGroups"].append({"name": "a"})
    assert any("used twice" in p for p in problems(m))
    bad = copy.deepcopy(minimal())
    bad["kind"] = "Job"
    assert problems(bad)[0].startswith("kind:")
    assert problems([1, 2])[0].startswith("manifest:")


def run_validate(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "diloco.cli", "validate", str(path)], capture_output=True, text=True, timeout=60)


def test_cli_validate_exit_codes(tmp_path: Path) -> None:
    ok = run_validate(ROOT / "examples" / "quickstart.yaml")
    assert ok.returncode == 0, ok.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(minimal(syncer={"quorum": 9})))
    res = run_validate(bad)
    assert res.returncode == 2
    assert res.stderr.strip() == (
        "spec.syncer.quorum: 9 exceeds the 4 learners in spec.learnerGroups; lower the quorum or add replicas"
    )
    broken = tmp_path / "broken.yaml"
    broken.write_text("spec: [unclosed")
    assert run_validate(broken).returncode == 2
    assert run_validate(tmp_path / "missing.yaml").returncode == 2
