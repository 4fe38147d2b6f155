"""`diloco validate` runs the operator's admission checks (operator/admission/checks.py), and `diloco --version`."""

from __future__ import annotations

import copy
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
import yaml

from diloco.operator.admission import checks as spec_checks
from diloco.operator.reconcile import passes
from diloco.spec import parse_job

ROOT = Path(__file__).resolve().parents[3]
TPU = yaml.safe_load((ROOT / "examples" / "k8s-tpu.yaml").read_text())


def diloco(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)


def write(tmp_path: Path, manifest: dict[str, Any]) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


@pytest.mark.slow
def test_a_tpu_slice_with_the_wrong_hosts_per_learner_exits_2_with_the_operators_message(tmp_path: Path) -> None:
    wrong = copy.deepcopy(TPU)
    wrong["spec"]["learnerGroups"][0]["hostsPerLearner"] = 2
    done = diloco("validate", str(write(tmp_path, wrong)))
    assert done.returncode == 2 and done.stdout == ""
    meta = {"name": wrong["metadata"]["name"], "namespace": "jobs"}
    _, operator_says = passes.load({**wrong, "metadata": {**wrong["metadata"], **meta, "uid": "u"}})
    assert operator_says == ["spec.learnerGroups[0].hostsPerLearner: a 4x4 TPU slice with 4 chips per pod "
                             "(google.com/tpu) has 4 host(s), and one learner takes a whole slice; set "
                             "hostsPerLearner to 4"]
    assert done.stderr.splitlines() == operator_says
    assert diloco("validate", str(ROOT / "examples" / "k8s-tpu.yaml")).returncode == 0


@pytest.mark.slow
def test_install_dependent_checks_follow_the_charts_settings(tmp_path: Path) -> None:
    routed = copy.deepcopy(TPU)
    routed["spec"]["syncer"]["expose"] = {"type": "GRPCRoute", "gateway": {"name": "wan"}, "host": "s.example.com",
                                       "tls": {"secretName": "syncer-tls"}}
    path = write(tmp_path, routed)
    refused = diloco("validate", str(path))
    assert refused.returncode == 2 and refused.stderr.startswith("spec.syncer.expose.type: GRPCRoute needs the "
                                                                 "Gateway API"), refused.stderr
    assert diloco("validate", "--gateway-api", str(path)).returncode == 0
    crowded = copy.deepcopy(TPU)
    crowded["spec"]["learnerGroups"] = [{**TPU["spec"]["learnerGroups"][0], "name": f"g{i}"} for i in range(8)]
    path = write(tmp_path, crowded)
    queued = diloco("validate", str(path))  # labelled with a queue: checked as Kueue sees it
    assert queued.returncode == 2 and "a Kueue Workload holds at most 8 PodSets" in queued.stderr
    assert diloco("validate", "--no-kueue", str(path)).returncode == 0


@pytest.mark.parametrize("example", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_every_example_passes_every_admission_check(example: str) -> None:
    job = parse_job(yaml.safe_load((ROOT / "examples" / example).read_text()))
    assert spec_checks.problems(job, gateway_api=False, kueue_enabled=True) == []


def test_version_prints_the_installed_package_version() -> None:
    done = diloco("--version")
    assert done.returncode == 0 and done.stdout == f"diloco {version('decoupled-diloco')}\n"


def test_a_bucket_without_its_filesystem_names_the_cloud_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    """`validate --inputs` (and `diloco run`) on a gs:// path where gcsfs is not installed: the
    problem names the field and the extra that reads it."""
    import fsspec.core

    from diloco import inputs

    def no_gcsfs(url: str) -> Any:
        raise ImportError("Install gcsfs to access Google Storage")

    monkeypatch.setattr(fsspec.core, "url_to_fs", no_gcsfs)
    job = copy.deepcopy(TPU)
    job["spec"]["data"]["source"].pop("tokenizer", None)
    problems = inputs.problems(parse_job(job))
    assert problems[0].startswith("spec.data.source.path: cannot read 'gs://my-bucket/llama-32k/train-*.bin': "
                                  "Install gcsfs")
    assert problems[0].endswith("(gs:// and s3:// need the cloud extra: pip install 'decoupled-diloco[learner,cloud]')")
