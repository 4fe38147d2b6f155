"""`diloco plan`: the paper's bandwidth example, the 12B x 4 regions plan, what it decides, its one
home manifest (validated, rendered on the operator, cut into each remote cluster's part), bad input."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from diloco.apps.cli import main
from diloco.apps.plan import figures as F
from diloco.apps.plan.model import shard_load, wire_rates

US = ["--region", "name=us-central,chips=4096,wan-gbps=5,latency-ms=5",
      "--region", "name=us-east,chips=4096,wan-gbps=2,latency-ms=20",
      "--region", "name=us-west,chips=4096,wan-gbps=3,latency-ms=25",
      "--region", "name=us-south,chips=4096,wan-gbps=4,latency-ms=15"]
PAPER_5B = ["--params", "5e9", "--region", "name=dc-a,wan-gbps=10", "--region", "name=dc-b,wan-gbps=10",
            "--fragments", "6"]


def plan_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, dict[str, Any]]:
    code = main(["plan", *argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_paper_5b_two_sites_bandwidth_within_10_percent(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = plan_json(capsys, *PAPER_5B)
    assert code == 0, out["problems"]
    for key, paper in F.PAPER_BANDWIDTH_GB_S.items():
        assert out["bandwidth_gb_s"][key] == pytest.approx(paper, rel=0.10), key


def test_12b_four_us_regions_is_planned_with_every_figure_sourced(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = plan_json(capsys, "--params", "12e9", *US, "--tau", "3")
    assert code == 0, out["problems"]
    assert [r["name"] for r in out["regions"]] == ["us-central", "us-east", "us-west", "us-south"]
    assert out["regions"][0]["syncer_here"] and not out["regions"][1]["syncer_here"]
    for r in out["regions"]:  # every region's link carries the plan in both directions
        assert 0 < r["up_bytes_per_s"] <= 0.8 * r["link_bytes_per_s"]
        assert r["down_bytes_per_s"] == pytest.approx(r["up_bytes_per_s"])  # int4 both ways, the defaults
        assert r["round_trip_s"] <= 3 * r["step_s"]
    assert out["shard_load"] <= 1.0 and out["goodput"] > 0.5 and out["checkpoint_bytes"] == pytest.approx(48e9, rel=0.01)
    assert out["figures"] and all(("BENCHMARKS" in f["source"] or "fit" in f["source"] or "line" in f["source"]
                                   or "codecs" in f["source"]) for f in out["figures"].values())
    # The shards P = 48 needs, not one shard at P = 48 x 4: every region reaches every shard (issue 63).
    assert (out["fragments"], out["shards"], out["learners"]) == (48, 4, 4)
    assert not any("fold" in x or "multi-cluster" in x for x in out["limits"])


def test_12b_at_the_default_tau_says_what_to_change(capsys: pytest.CaptureFixture[str]) -> None:
    code, out = plan_json(capsys, "--params", "12e9", *US)
    assert code == 2
    assert any("raise --tau to 3" in p for p in out["problems"]), out["problems"]


def test_the_chain_model_reproduces_its_two_measurements() -> None:
    ref = F.REF_FRAGMENT_PARAMS.value
    assert shard_load(ref, 1.0, F.SHARD_LEARNERS_1S.value) == pytest.approx(1.0)
    assert shard_load(ref, 0.5, F.SHARD_LEARNERS_05S.value / 0.5) == pytest.approx(1.0)
    assert shard_load(ref, 1.0, F.SHARD_LEARNERS_1S.value + 1) > 1.0


# What the plan decides: (argv, P a shard, shards, learners per region). Multi-region plans keep
# their shards: a sharded syncer is exposed shard by shard to every cluster (spec.syncer.expose).
DECIDES = [
    (["--params", "12e9", *US, "--tau", "3"], 48, 4, [1, 1, 1, 1]),
    (PAPER_5B, 6, 11, [1, 1]),
    (["--params", "5e9", "--region", "name=dc-a,wan-gbps=2.5", "--region", "name=dc-b,wan-gbps=2.5"], 24, 3, [1, 1]),
    (["--params", "1e9", "--tau", "3", "--region", "name=a,learners=8,wan-gbps=100",
      "--region", "name=b,learners=8,wan-gbps=100"], 24, 2, [8, 8]),
    (["--params", "12e9", "--region", "name=us-central,learners=4,step-time=2,wan-gbps=100", "--fragments", "24"],
     24, 4, [4]),
]


@pytest.mark.parametrize(("argv", "fragments", "shards", "learners"), DECIDES)
def test_what_the_plan_decides(argv: list[str], fragments: int, shards: int, learners: list[int],
                               capsys: pytest.CaptureFixture[str]) -> None:
    code, out = plan_json(capsys, *argv)
    assert code == 0, out["problems"]
    assert (out["fragments"], out["shards"], [r["learners"] for r in out["regions"]]) == (fragments, shards, learners)
    assert "folded_from" not in out and out["shard_load"] <= 1.0
    for r in out["regions"]:  # each region's bytes: 1/P of the model a step per learner, whatever the shards
        up, down = wire_rates(out["params"], fragments, r["learners"], r["step_s"])
        assert (r["up_bytes_per_s"], r["down_bytes_per_s"]) == (round(up), round(down))


def test_one_home_manifest_validates_renders_and_cuts_a_part_per_cluster(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The 12B x 4 plan writes one job for the home cluster (issue 63): its operator's home view
    renders the syncer's 4 shards, each exposed, and us-central's learners; `remote_spec` cuts each
    other region's learners-only part, dialling every shard at shard-<i>.<host>."""
    from diloco.apps.commands import cmd_validate
    from diloco.operator.render import job as render
    from diloco.spec import DecoupledDiLoCoJob, home_view, load_job, remote_spec

    out = tmp_path / "job.yaml"
    assert main(["plan", "--params", "12e9", *US, "--tau", "3", "--name", "llama-12b", "--manifest", str(out)]) == 0
    assert [f.name for f in tmp_path.iterdir()] == ["job.yaml"]  # one object, not one per cluster
    assert f"wrote {out}" in capsys.readouterr().out
    assert cmd_validate(argparse.Namespace(file=str(out), gateway_api=False, inputs=False, no_kueue=False)) == 0, \
        capsys.readouterr().err
    job = load_job(str(out))
    spec = job.spec
    assert [(c.name, c.kubeconfig_secret) for c in spec.clusters] == [
        ("us-east", "diloco-us-east"), ("us-west", "diloco-us-west"), ("us-south", "diloco-us-south")]
    assert [(g.name, g.region, g.replicas, g.cluster) for g in spec.learner_groups] == [
        ("us-central", "us-central", 1, None), ("us-east", "us-east", 1, "us-east"),
        ("us-west", "us-west", 1, "us-west"), ("us-south", "us-south", 1, "us-south")]
    expose = spec.syncer.expose
    assert (spec.syncer.shards, spec.syncer.fragments, spec.syncer.grace_window.tau) == (4, 48, 3)
    assert expose is not None and (expose.type, expose.host, expose.tls.secret_name) == (
        "LoadBalancer", "syncer.llama-12b.example.com", "llama-12b-syncer-tls")

    owner = render.Owner("llama-12b", "research", "uid-1")
    home = job.model_copy(update={"spec": home_view(spec)})
    kids = render.children(home, owner, "t" * 43, started=False, finished=False)
    kinds = {(o["kind"], o["metadata"]["name"]) for o in kids}
    assert {("StatefulSet", "llama-12b-us-central"), ("ConfigMap", "llama-12b-config")} <= kinds
    assert any(k in ("StatefulSet", "Deployment") and name == "llama-12b-syncer" for k, name in kinds)
    assert sum(o["kind"] == "Service" and o["spec"].get("type") == "LoadBalancer" for o in kids) == 4  # a shard each
    assert not any(name.endswith(("us-east", "us-west", "us-south")) for _, name in kinds)  # theirs run there
    assert home.spec.syncer.remote_regions == ["us-east", "us-west", "us-south"]

    endpoints = [f"shard-{i}.syncer.llama-12b.example.com:50051" for i in range(4)]
    for offset, cluster in enumerate(("us-east", "us-west", "us-south"), start=1):
        part = remote_spec(spec, cluster, endpoints=endpoints, token_secret="llama-12b-syncer")
        assert [(g.name, g.shard_offset) for g in part.learner_groups] == [(cluster, offset)]
        assert part.data.shards == 4 and part.syncer.shards == 4 and part.syncer.expose is None
        kids = render.children(DecoupledDiLoCoJob(metadata=job.metadata, spec=part), owner, "t" * 43,
                               started=False, finished=False)
        learners = [o for o in kids if o["kind"] == "StatefulSet"]
        assert [o["metadata"]["name"] for o in learners] == [f"llama-12b-{cluster}"]
        args = learners[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert args[args.index("--syncer") + 1] == ",".join(endpoints)
        assert not any(o["kind"] in ("Deployment", "PersistentVolumeClaim") for o in kids)  # learners only


def test_a_single_region_plan_keeps_its_shards(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from diloco.spec import load_job

    code, out = plan_json(capsys, "--params", "12e9", "--region", "name=us-central,learners=4,step-time=2,wan-gbps=100",
                          "--fragments", "24", "--manifest", str(tmp_path / "one.yaml"))
    assert code == 0, out["problems"]
    assert out["shards"] > 1
    spec = load_job(str(tmp_path / "one.yaml")).spec
    assert spec.syncer.shards == out["shards"] and spec.clusters == [] and spec.syncer.expose is None


@pytest.mark.parametrize(("argv", "says"), [
    (["--params", "5e9", "--region", "name=a,wan-gbps=0.5", "--region", "name=b", "--fragments", "24"],
     "raise wan-gbps to"),
    (["--params", "12e9", "--region", "name=a,learners=400,step-time=0.5,wan-gbps=10000", "--fragments", "24"],
     "they take at most 9 learners at 0.5 s steps"),
    (["--params", "5e9", "--region", "name=a,step-time=-1"], "step-time=-1"),
    (["--params", "5e9", "--region", "name=a,wan-gbps=fast"], "wan-gbps='fast' is not a number"),
    (["--params", "5e9", "--region", "name=a,bandwidth=3"], "'bandwidth' is not a key"),
    (["--params", "5e9", "--region", "wan-gbps=3"], "give it a name"),
    (["--params", "5e9", "--region", "name=a", "--region", "name=a"], "appears twice"),
    (["--params", "5e9", "--region", "name=a", "--utilization", "1.5"], "--utilization"),
    (["--params", "5e9"], "--region: no regions"),
    (["--params", "1e3", "--region", "name=a"], "--params"),
    (["--params", "nan", "--region", "name=a"], "--params"),
    (["--from", "/nonexistent.yaml", "--region", "name=a"], "cannot read"),
])
@pytest.mark.slow
def test_bad_input_gets_a_plan_that_says_what_to_change(argv: list[str], says: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *argv]) == 2
    text = capsys.readouterr().out
    assert "change:" in text and says in text, text


def test_regions_from_yaml_and_a_manifest_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    regions = tmp_path / "regions.yaml"
    regions.write_text("- {name: home, wan-gbps: 10, learners: 2}\n- {name: away, wan-gbps: 10}\n")
    example = Path(__file__).resolve().parents[3] / "examples" / "multicluster-home.yaml"
    code, out = plan_json(capsys, "--from", str(example), "--regions", str(regions))
    assert code == 0, out["problems"]
    assert "48 layers" in out["model"] and [r["learners"] for r in out["regions"]] == [2, 1]


def test_the_command_line_end_to_end() -> None:
    done = subprocess.run([sys.executable, "-m", "diloco.apps.cli", "plan", *PAPER_5B], capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "data-parallel 100" in done.stdout and "figures used:" in done.stdout and "Traceback" not in done.stderr


def test_a_pretrained_manifest_is_sized_from_its_config_json(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "llama-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
        "num_attention_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096}))
    job = tmp_path / "job.yaml"
    job.write_text("apiVersion: diloco.dev/v1alpha1\nkind: DecoupledDiLoCoJob\nmetadata: {name: ft}\n"
                   f"spec:\n  learnerGroups: [{{name: a}}]\n  model: {{pretrained: {model}, context: 2048}}\n")
    code, out = plan_json(capsys, "--from", str(job), "--region", "name=a,wan-gbps=100")
    assert code == 0, out["problems"]
    assert out["params"] == pytest.approx(6.74e9, rel=0.01)  # Llama 2 7B
