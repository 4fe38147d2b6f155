"""The job spec: defaults, field-path errors, and `diloco validate`."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from diloco.spec import SpecError, dump_job, load_job, parse_job

OUTER_LR, OUTER_MOMENTUM = 0.6, 0.0  # the measured defaults (docs/BENCHMARKS.md, "The outer step")

ROOT = Path(__file__).resolve().parents[3]
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
    # DiLoCo's 0.7 / 0.9 were tuned for a sync every ~500 steps; ours syncs each fragment every
    # P steps, where they overshoot (docs/BENCHMARKS.md, the outer-step sweep).
    assert (s.syncer.outer_learning_rate, s.syncer.outer_momentum) == (OUTER_LR, OUTER_MOMENTUM)
    assert (s.syncer.compression, s.syncer.merge, s.syncer.fragmentation) == ("int4", "rda", "balanced")
    assert s.syncer.adoption == "rebase" and [str(x) for x in s.learner_ids()] == ["a-0", "a-1", "a-2", "a-3"]


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
    return subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "validate", str(path)], capture_output=True, text=True, timeout=60)


@pytest.mark.slow
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


def test_data_shards_are_disjoint_within_and_across_clusters() -> None:
    groups = [{"name": "a", "replicas": 2}, {"name": "b", "replicas": 3}]
    s = parse_job(minimal(learnerGroups=groups)).spec
    assert s.shard_count == 5 and [s.shard_of("a", 1), s.shard_of("b", 0)] == [(1, 5), (2, 5)]
    assert s.shard_of("a", 2) == (7, 5)  # a scavenger past its group's replicas: no shard of its own
    remote = parse_job(minimal(learnerGroups=[{"name": "a", "replicas": 2, "shardOffset": 8}, {"name": "b"}],
                               data={"shards": 12})).spec
    assert remote.shard_offsets() == [8, 10] and remote.shard_of("b", 0) == (10, 12)
    bad = problems(minimal(learnerGroups=[{"name": "a", "replicas": 2, "shardOffset": 1},
                                          {"name": "b", "replicas": 2, "shardOffset": 0},
                                          {"name": "c", "replicas": 2, "shardOffset": 3}], data={"shards": 4}))
    assert bad == [
        "spec.learnerGroups[1].shardOffset: shards 0..1 of group 'b' overlap group 'a' (1..2); give each group "
        "its own range",
        "spec.learnerGroups[2].shardOffset: shards 3..4 of group 'c' exceed spec.data.shards (4); raise "
        "spec.data.shards or lower shardOffset"]
    # A home cluster's quorum may count other clusters' learners (spec.data.shards counts them all).
    assert parse_job(minimal(syncer={"quorum": 6}, data={"shards": 8})).spec.syncer.quorum == 6
    assert problems(minimal(syncer={"quorum": 9}, data={"shards": 8}))[0].startswith(
        "spec.syncer.quorum: 9 exceeds the 8 learners in spec.data.shards")
    assert problems(minimal(learnerGroups=[{"name": "a", "shardOffset": 1}]))[0].startswith(
        "spec.learnerGroups[0].shardOffset: needs spec.data.shards")


def test_learners_only_clusters_must_place_their_shards() -> None:
    external = {"external": {"endpoint": "syncer.example.com:50051", "tokenSecret": "home-token"}}
    assert problems(minimal(syncer=external))[0].startswith("spec.data.shards: a cluster that only hosts learners")
    assert problems(minimal(syncer=external, data={"shards": 8}))[0].startswith(
        "spec.learnerGroups[0].shardOffset: a cluster that only hosts learners must place")
    ok = parse_job(minimal(syncer={**external, "quorum": 9}, data={"shards": 8},
                           learnerGroups=[{"name": "a", "replicas": 4, "shardOffset": 4}]))
    assert ok.spec.syncer.quorum == 9  # the home cluster's syncer decides; this copy is not checked
    assert problems(minimal(syncer={**external, "expose": {}}, data={"shards": 8},
                            learnerGroups=[{"name": "a", "replicas": 4, "shardOffset": 4}])) == [
        "spec.syncer.expose: the syncer is external (spec.syncer.external), so there is none here to expose; "
        "remove one of the two"]
    assert problems(minimal(syncer={"external": {"endpoint": "https://x", "tokenSecret": "Home"}})) == [
        "spec.syncer.external.endpoint: 'https://x' is not host:port, nor host:port|host:port (a shard's "
        "syncer and its standby in another cluster)",
        "spec.syncer.external.tokenSecret: 'Home' is not a DNS name (lower-case letters, digits, '-' and '.')"]


def test_pod_overlay_names_are_checked_as_every_other_dns_name() -> None:
    """One pattern for DNS names (diloco/spec/base.py), so a pod's names get the same error that names the fix."""
    pod = {"serviceAccountName": "Bucket_Reader", "priorityClassName": "a..b", "imagePullSecrets": [{"name": "-x"}]}
    assert problems(minimal(learnerGroups=[{"name": "a", "pod": pod}])) == [
        f"spec.learnerGroups[0].pod.{field}: {value!r} is not a DNS name (lower-case letters, digits, '-' and '.')"
        for field, value in (("serviceAccountName", "Bucket_Reader"), ("imagePullSecrets[0].name", "-x"),
                             ("priorityClassName", "a..b"))]


def test_exposure_needs_a_certificate_unless_tls_is_off() -> None:
    assert problems(minimal(syncer={"expose": {}})) == [
        "spec.syncer.expose.tls.secretName: TLS is on when the syncer is exposed; name a kubernetes.io/tls "
        "Secret holding tls.crt, tls.key and ca.crt, or set spec.syncer.expose.tls.enabled: false"]
    assert parse_job(minimal(syncer={"expose": {"tls": {"enabled": False}}})).spec.syncer.expose is not None
    route = problems(minimal(syncer={"expose": {"type": "GRPCRoute", "loadBalancerSourceRanges": ["10.0.0.0/8"],
                                                "tls": {"secretName": "t"}}}))
    assert [p.split(":")[0] for p in route] == ["spec.syncer.expose.gateway",
                                               "spec.syncer.expose.loadBalancerSourceRanges"]


def test_managed_by_names_the_controller() -> None:
    assert parse_job(minimal()).spec.runs_here()
    assert parse_job(minimal(managedBy="diloco.dev/operator")).spec.runs_here()
    assert not parse_job(minimal(managedBy="kueue.x-k8s.io/multikueue")).spec.runs_here()
    assert problems(minimal(managedBy="MultiKueue"))[0].startswith("spec.managedBy:")


def test_syncer_shards_cut_every_slot_and_are_exposed_one_name_each() -> None:
    syncer = parse_job(minimal(syncer={"fragments": 4, "shards": 5})).spec.syncer
    assert (syncer.shards, syncer.plan_size) == (5, 20)  # each slot's 1/P of the model cut in 5
    assert problems(minimal(syncer={"shards": 2, "expose": {"tls": {"enabled": False}}}))[0].startswith(
        "spec.syncer.expose.host: a sharded syncer is exposed as shard-<i>.<host>")
    routed = {"type": "GRPCRoute", "gateway": {"name": "g"}, "tls": {"enabled": False}}
    assert problems(minimal(syncer={"shards": 2, "expose": routed}))[0].startswith(
        "spec.syncer.expose.host: a sharded syncer is exposed as shard-<i>.<host>")
    assert parse_job(minimal(syncer={"shards": 2, "expose": {**routed, "host": "s.example.com"}}))
    assert parse_job(minimal(syncer={"shards": 2, "expose": {"host": "s.example.com", "tls": {"enabled": False}}}))
    assert problems(minimal(syncer={"shards": 0}))[0].startswith("spec.syncer.shards:")


def test_an_external_sharded_syncer_is_named_one_address_per_shard() -> None:
    remote = {"shards": 4}, [{"name": "a", "replicas": 4, "shardOffset": 4}]
    ext = {"endpoints": ["shard-0.s.example.com:50051", "shard-1.s.example.com:50051"], "tokenSecret": "t"}
    job = minimal(learnerGroups=remote[1], data=remote[0], syncer={"shards": 2, "external": ext})
    job["spec"]["data"]["shards"] = 8
    assert parse_job(job).spec.syncer.external.addresses == ext["endpoints"]
    three = {**job, "spec": {**job["spec"], "syncer": {"shards": 3, "external": ext}}}
    assert problems(three) == ["spec.syncer.external.endpoints: 2 address(es) for a syncer of 3 shard(s) "
                               "(spec.syncer.shards); name one host:port per shard, in shard order"]
    both = {**job, "spec": {**job["spec"], "syncer": {"shards": 2, "external": {**ext, "endpoint": "s:1"}}}}
    assert problems(both)[0].startswith("spec.syncer.external: name the syncer by `endpoint` (one shard) or")


def test_decay_steps_left_out_end_the_cosine_with_the_token_budget_or_the_last_step() -> None:
    """The schedule's position is the job's tokens over M learners' batch, so a budget of
    M x batch x context x 700 tokens decays over exactly 700 steps; an explicit value wins."""
    tokens_per_job_step = 4 * 8 * 256  # M learners x batchSize x context
    budget = parse_job(minimal(model={"context": 256}, training={"batchSize": 8, "tokenBudget": 700 * tokens_per_job_step}))
    assert budget.spec.training.decay_steps == 700
    one_more = minimal(model={"context": 256}, training={"tokenBudget": 700 * tokens_per_job_step + 1})
    assert parse_job(one_more).spec.training.decay_steps == 701  # rounded up: the cosine never ends early
    assert parse_job(minimal(training={"steps": 900})).spec.training.decay_steps == 900
    assert parse_job(minimal(training={"steps": 900, "decaySteps": 1500})).spec.training.decay_steps == 1500
    assert parse_job(minimal()).spec.training.decay_steps == 2000
    assert parse_job(dump_job(budget)) == budget  # the derived value round-trips
    # Too short to finish the warmup (a status test's 1000-token budget): the cosine starts after it.
    assert parse_job(minimal(training={"steps": 30})).spec.training.decay_steps == 51
    assert parse_job(minimal(training={"tokenBudget": 1000})).spec.training.decay_steps == 51
    assert problems(minimal(training={"steps": 30, "decaySteps": 30})) == [
        "spec.training.warmupSteps: 50 must be below spec.training.decaySteps (30)"]
