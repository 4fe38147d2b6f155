"""A plan as text, as JSON, and as the one DecoupledDiLoCoJob manifest that runs it.

A multi-region plan is one job (diloco/spec/clusters.py): applied on the home cluster, the
syncer's region, whose operator writes each other region's learners-only part into that region's
cluster (`spec.clusters`). Every shard of the syncer is exposed with TLS (shard-<i>.<host>), so
the learners of every region reach all of them; the data slices follow the groups' order.
"""

from __future__ import annotations

import math
import re
from typing import Any

from diloco.apps.plan import figures as F
from diloco.apps.plan.model import Plan
from diloco.spec import TransformerModel

GBIT = 1e9 / 8


def _gbit(bps: float) -> str:
    return f"{bps / GBIT:.3g} Gbit/s"


def _used_figures() -> list[tuple[str, F.Figure]]:
    return [(name.lower(), value) for name, value in vars(F).items() if isinstance(value, F.Figure)]


def text(plan: Plan, model: str) -> str:
    """What a platform team reads: every figure with where it came from."""
    p = plan.inputs
    head = f"diloco plan: {p.params / 1e9:.3g}B parameters ({model}), {len(p.regions)} region(s), " \
           f"target utilization {p.utilization:.0%}"
    if plan.problems:
        return "\n".join([head, "", "cannot plan this run; change:", *(f"  - {x}" for x in plan.problems)])
    lines = [head, "", f"learners and links (up: {F.UP_CODEC} pushes; down: {F.DOWN_CODEC} deltas; "
                       "+ protocol overhead, BENCHMARKS §2)"]
    lines.append(f"  {'region':<14}{'learners':>9}{'chips':>8}{'step':>7}{'link':>14}{'up':>14}{'down':>14}"
                 f"{'link used':>10}{'round trip':>11}{'Join':>8}{'goodput':>9}")
    for rp in plan.regions:
        used = max(rp.up_bps, rp.down_bps) / rp.link_bps
        lines.append(f"  {rp.region.name + (' *' if not rp.remote else ''):<14}{rp.learners:>9}{rp.chips:>8}"
                     f"{rp.region.step_s:>6g}s{rp.region.wan_gbps:>9g} Gbit/s{_gbit(rp.up_bps):>14}"
                     f"{_gbit(rp.down_bps):>14}{used:>10.1%}{rp.round_trip_s:>10.2f}s{rp.pull_s:>7.0f}s"
                     f"{rp.goodput.goodput:>9.1%}")
    lines.append("  (* the syncer's region; round trip: the largest fragment's, against tau x step = "
                 f"{p.tau} x step; Join: a re-admitted learner's pull of Θ)")
    lines += ["", f"fragments: P = {plan.fragments} per shard ({plan.fragments * plan.shards} fragments in all); "
                  f"each fragment syncs every {plan.fragments} steps "
                  f"({plan.period_s:g} s); largest fragment {plan.fragment_params / 1e6:.0f}M parameters "
                  f"(mean {p.params / (plan.fragments * plan.shards) / 1e6:.0f}M)",
              f"syncer: {plan.shards} shard(s), {p.cores_per_shard} core each, peak {plan.shard_memory_b / 1e9:.1f} GB "
              f"each, on {plan.hosts} host(s) of {p.host_cores} cores / {p.host_memory_gb:g} GB; the chain "
              f"uses {plan.shard_load:.0%} of each {plan.step_s:g} s slot on average; "
              f"{plan.learners} learners, {sum(r.learners / r.region.step_s for r in plan.regions):.1f} pushes/s",
              f"checkpoints: {plan.checkpoint_b / 1e9:.3g} GB (Θ in fp32) over {plan.shards} volume(s), every "
              f"{plan.checkpoint_interval_s:g} s (one write {plan.checkpoint_write_s:.0f} s at "
              f"{F.CHECKPOINT_WRITE_BPS.value / 1e6:.0f} MB/s; at most a quarter of the time writing)",
              f"goodput: {plan.goodput:.1%} of the chips' time, uptime {plan.uptime:.2%} (goodput simulator, "
              f"{p.days:g} days x {p.seeds} seeds per region at its failure rate; learners only)",
              "",
              f"the paper's comparison at this size (P = {plan.fragments}, "
              f"{max(2, len(p.regions))} sites, "
              f"{p.utilization:.0%} utilization; apps/sim/bandwidth.py), GB/s per site:",
              f"  data-parallel {plan.paper['dp']:.3g}, Decoupled bf16 {plan.paper['decoupled_bf16']:.3g}, "
              f"int4 {plan.paper['decoupled_int4']:.3g}   (paper at 5B, 1 s, 2 sites, P unstated: "
              f"{F.PAPER_BANDWIDTH_GB_S['dp']:g}, {F.PAPER_BANDWIDTH_GB_S['decoupled_bf16']:g}, "
              f"{F.PAPER_BANDWIDTH_GB_S['decoupled_int4']:g})",
              "", "what limits it, tightest first:", *(f"  - {x}" for x in plan.limits),
              "", "figures used:"]
    lines += [f"  - {name}: {fig.value:.4g} {fig.unit} ({fig.source})" for name, fig in _used_figures()]
    return "\n".join(lines)


def as_json(plan: Plan, model: str) -> dict[str, Any]:
    p = plan.inputs
    out: dict[str, Any] = {"params": p.params if math.isfinite(p.params) else None, "model": model,
                           "problems": plan.problems}
    if plan.problems:
        return out
    out.update({
        "fragments": plan.fragments, "period_s": plan.period_s, "shards": plan.shards, "tau": p.tau,
        "step_s": plan.step_s, "pushes_per_s_per_shard": sum(r.learners / r.region.step_s for r in plan.regions),
        "largest_fragment_params": plan.fragment_params, "shard_load": round(plan.shard_load, 4),
        "shard_memory_bytes": round(plan.shard_memory_b), "hosts": plan.hosts, "learners": plan.learners,
        "checkpoint_bytes": round(plan.checkpoint_b), "checkpoint_interval_s": plan.checkpoint_interval_s,
        "goodput": round(plan.goodput, 4), "uptime": round(plan.uptime, 4),
        "bandwidth_gb_s": {k: round(v, 4) for k, v in plan.paper.items()},
        "paper_bandwidth_gb_s": F.PAPER_BANDWIDTH_GB_S,
        "regions": [{"name": rp.region.name, "syncer_here": not rp.remote, "learners": rp.learners,
                     "chips": rp.chips, "step_s": rp.region.step_s, "link_bytes_per_s": rp.link_bps,
                     "up_bytes_per_s": round(rp.up_bps), "down_bytes_per_s": round(rp.down_bps),
                     "round_trip_s": round(rp.round_trip_s, 3), "join_s": round(rp.pull_s, 1),
                     "goodput": round(rp.goodput.goodput, 4), "uptime": round(rp.goodput.uptime, 4)}
                    for rp in plan.regions],
        "limits": plan.limits,
        "figures": {name: {"value": fig.value, "unit": fig.unit, "source": fig.source}
                    for name, fig in _used_figures()},
    })
    return out


def group_name(region: str) -> str:
    """A DNS label for the region's learner group."""
    label = re.sub(r"[^a-z0-9-]+", "-", region.lower()).strip("-")[:40].strip("-")
    return label or "region"


def cluster_name(region: str) -> str:
    """A remote region's name in spec.clusters (a DNS label, as its learner group's)."""
    return group_name(region)


def manifest(plan: Plan, model: TransformerModel, name: str, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The one job that runs the plan, applied on the home cluster (the syncer's region): a
    learner group per region, the remote ones in `spec.clusters` (kubeconfig Secret
    `diloco-<cluster>`), and, across regions, every syncer shard exposed by a LoadBalancer as
    shard-<i>.<host> with TLS. `base`: a manifest's spec (--from) whose data and training are kept."""
    p = plan.inputs
    base = base or {}
    remote = [rp for rp in plan.regions if rp.remote]
    home = [rp for rp in plan.regions if not rp.remote]

    def group(rp: Any) -> dict[str, Any]:
        g = {"name": group_name(rp.region.name), "region": rp.region.name, "replicas": rp.learners}
        return {**g, "cluster": cluster_name(rp.region.name)} if rp.remote else g

    syncer: dict[str, Any] = {
        "fragments": plan.fragments, "shards": plan.shards, "compression": F.UP_CODEC, "quorum": 1,
        "broadcastCompression": F.DOWN_CODEC, "graceWindow": {"tau": p.tau},
        "checkpointIntervalSeconds": plan.checkpoint_interval_s,
        "checkpointStorage": f"{max(1, math.ceil(2 * plan.checkpoint_b / plan.shards / 2**30))}Gi",  # two checkpoints
        "resources": {"requests": {"cpu": str(p.cores_per_shard),
                                   "memory": f"{math.ceil(plan.shard_memory_b / 2**30)}Gi"}},
    }
    spec: dict[str, Any] = {
        "learnerGroups": [group(rp) for rp in home + remote],  # the home region's first: data slices 0..
        "syncer": syncer,
        "model": model.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_unset=False,
                                  exclude={"preset"}),
        "data": {**base.get("data", {}), "shards": plan.learners},
        "training": base.get("training", {}),
    }
    if remote:
        syncer["expose"] = {"type": "LoadBalancer", "host": f"syncer.{name}.example.com",
                            "tls": {"secretName": f"{name}-syncer-tls"}}
        spec = {"clusters": [{"name": cluster_name(rp.region.name),
                              "kubeconfigSecret": f"diloco-{cluster_name(rp.region.name)}"} for rp in remote], **spec}
    return {"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": name},
            "spec": spec}
