"""A plan's WAN checked: each region's learner over a link shaped at its planned rate, scaled down.

    sudo nice -n 10 python bench/plan_wan.py [--plan "ARGS of diloco plan"] [--windows given,planned,half]
                                             [--seconds 45] [--slowdown 4]

Runs `diloco plan ARGS --json`, then the real `diloco syncer` (in a "home" network namespace)
and one real `diloco learner` a region, each in its own namespace behind a veth link shaped
with tbf both ways (apps/testkit/wan.py), over a small GPT of P tensors (the plan's P and tau,
the plan's codecs: int4 pushes and deltas back). A region's bytes/s scale from the plan's by the model's ratio
(scaled / planned parameters) and the steps per second's (the plan's step / the bench's, its
fastest learner's unthrottled step): through `wire_rates` of apps/plan/model.py, as the plan
computes them. First the links unshaped (each learner's own tokens/s, the reference), then
each window of `--windows` in turn, `--settle` seconds after the change, for `--seconds`:

- given: each region's link as the plan was given it (`wan-gbps`), scaled;
- planned: each region at the least link the plan accepts for its bytes: max(up, down) over
  `--link-share` (0.8), scaled;
- accepted: each region at the slowest link `diloco plan` accepts for it at the plan's P
  (bytes and the largest fragment's round trip within tau steps; found by bisection), scaled;
- half: the slowest-given region at half of planned, the others at planned;
- NAME*F: that window's links F times as fast.

It also asks `diloco plan` (real size, P fixed and free) about the planned links and the half one.
Per learner and window: tokens/s against its unthrottled, steps, pushes accepted (the syncer's
Status), pushes refused, the mean version lag of its accepted pushes, slots skipped (a push
later than its slot's close moves a learner's schedule on), and how many merges it had not
yet received at the window's end. Last line: JSON.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import secrets
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_replay import GPT_OTHER_TENSORS, GPT_TENSORS_PER_LAYER, PLAN_12B, plan_of
from syncer_scale import REPO

from diloco.apps.plan import figures as F
from diloco.apps.plan.model import wire_rates
from diloco.contract import CACHE_EVERY_PROGRAM, STEP_CACHE_ENV
from diloco.shapes import parameter_shapes
from diloco.spec import TransformerModel

PORT = 50200  # in the home namespace; nothing else listens there
D_MODEL = 128  # the scaled GPT's width: fragments of ~25K parameters (the 12B plan's: 62M)
TENSORS_PER_FRAGMENT = 1  # the scaled GPT's depth: P tensors (deeper ones took over 5 minutes to compile here)
# The 12B plan's balanced fragments are within +18%/-7% of the mean (its embedding's 2x apart), so
# its links carry even bytes slot after slot. A scaled GPT of P tensors has one tensor a fragment:
# balanced, the schedule's first quarter of slots would carry 2.6x the mean and the rest 0.66x, a
# burst no real-size plan has; cut by layer, any 16 slots carry within -4%/+16% of the mean (the
# largest fragment 2.6x, as the plan's embedding is 2x). The bytes a cycle are the same either way.
FRAGMENTATION = "layer"
CONTEXT = 32  # short sequences: the link's load is per step, the CPU's per token (4 learners on 2 shared cores)
BATCH = 2  # sequences a step: 64 tokens
TOLERANCE = 0.15  # tokens/s at least 85% of unthrottled: the spread of a shared 2-core machine's CPU
# This bench runs one syncer shard. The 12B x 4 plan now keeps its 4 shards at P = 48 (issue 63);
# at P = 192 it plans the one shard it had when folded (the same bytes a region), which the
# measured rows of docs/PLANNING.md ran.
PLAN_12B_ONE_SHARD = PLAN_12B + " --fragments 192"


def link_share(plan_args: str) -> float:
    """The plan's headroom (`--link-share`), read by the plan's own parser."""
    from diloco.apps.plan import cli as plan_cli

    parser = argparse.ArgumentParser()
    plan_cli.add_parser(parser.add_subparsers())
    return float(parser.parse_args(["plan", *shlex.split(plan_args)]).link_share)


def with_link(plan_args: str, region: str, gbps: float) -> str:
    """The plan's arguments with one region's wan-gbps replaced."""
    def fix(m: re.Match[str]) -> str:
        spec = m.group(1)
        if f"name={region}," not in spec + ",":
            return m.group(0)
        return "--region " + re.sub(r"wan-gbps=[^,\s]+", f"wan-gbps={gbps:.4g}", spec)
    return re.sub(r"--region\s+(\S+)", fix, plan_args)


def plan_says(plan_args: str) -> dict[str, Any]:
    """`diloco plan`'s verdict: its P, or the problems it names."""
    out = subprocess.run([sys.executable, "-m", "diloco.apps.cli", "plan", *shlex.split(plan_args), "--json"],
                         capture_output=True, text=True, cwd=REPO, check=False)
    got = json.loads(out.stdout)
    return {"args": plan_args, "exit": out.returncode, "fragments": got.get("fragments"),
            "problems": got.get("problems", [])}


def least_link(plan_args: str, region: str, given: float, floor: float, fragments: int) -> float:
    """The slowest link (Gbit/s) `diloco plan` accepts for `region` at P = `fragments`, to 1%:
    its bytes within the link share and its largest fragment's round trip within tau steps."""
    def plans(gbps: float) -> bool:
        return not plan_says(f"{with_link(plan_args, region, gbps)} --fragments {fragments}")["problems"]
    lo, hi = floor, given
    if plans(lo):
        return lo
    while hi - lo > 0.01 * hi:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if plans(mid) else (mid, hi)
    return hi


def job(plan: dict[str, Any], layers: int, d_model: int, slowdown: float) -> dict[str, Any]:
    groups = [{"name": r["name"], "region": r["name"], "replicas": r["learners"], "slowdown": slowdown}
              for r in plan["regions"]]
    return {
        "apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "plan-wan"},
        "spec": {
            "learnerGroups": groups,
            "syncer": {"fragments": plan["fragments"], "fragmentation": FRAGMENTATION, "compression": F.UP_CODEC,
                       "broadcastCompression": F.DOWN_CODEC,  # the codecs the plan's rates are for
                       "graceWindow": {"tau": plan["tau"]}, "checkpointIntervalSeconds": 100000},
            "model": {"layers": layers, "dModel": d_model, "heads": max(1, d_model // 64), "context": CONTEXT},
            "training": {"batchSize": BATCH, "warmupSteps": 20, "decaySteps": 100000, "evalIntervalSteps": 1000000},
        },
    }


class Learner:
    """One `diloco learner` in its region's namespace; its progress events, as they come."""

    def __init__(self, net: Any, region: str, index: int, cpu: int, config: Path, env: dict[str, str]):
        self.region, self.events, self.name = region, list[dict[str, Any]](), f"{region}-{index}"
        argv = [sys.executable, "-P", "-m", "diloco.apps.cli", "learner", "--config", str(config), "--group", region,
                "--index", str(index), "--syncer", f"{net.links[region].home_ip}:{PORT}", "--cpus", str(cpu)]
        self.proc = subprocess.Popen(net.argv(region, argv), env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, start_new_session=True, cwd=REPO)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                e = json.loads(line)
            except json.JSONDecodeError:
                continue
            if e.get("event") == "progress":
                self.events.append(e)

    def last(self) -> dict[str, Any]:
        return self.events[-1]


def status(net: Any, env: dict[str, str]) -> dict[str, Any]:
    out = subprocess.run(net.argv("home", [sys.executable, "-P", "-m", "diloco.apps.cli", "status", "--syncer",
                                           f"127.0.0.1:{PORT}"]), env=env, capture_output=True, text=True, cwd=REPO)
    return dict(json.loads(out.stdout))


def window(net: Any, env: dict[str, str], learners: list[Learner], seconds: float) -> dict[str, Any]:
    """Every learner's figures over `seconds` from now."""
    s0, e0 = status(net, env), [ln.last() for ln in learners]
    time.sleep(seconds)
    e1 = [ln.last() for ln in learners]
    s1 = status(net, env)
    by = [{x["region"]: x for x in s.get("learners", [])} for s in (s0, s1)]
    outer = sum(int(v) for v in s1.get("versions", []))
    rows = {}
    for ln, a, b in zip(learners, e0, e1, strict=True):
        dt = b["t"] - a["t"]
        c0, c1 = by[0].get(ln.region, {}), by[1].get(ln.region, {})
        pushed = int(c1.get("contributions", 0)) - int(c0.get("contributions", 0))
        regions = [{x["region"]: x for x in s.get("regions", [])}.get(ln.region, {}) for s in (s0, s1)]
        lag = [float(r.get("mean_staleness", 0)) * int(r.get("contributions", 0)) for r in regions]
        rows[ln.region] = {
            "tokens_per_s": round((b["trained_tokens"] - a["trained_tokens"]) / dt, 1) if dt > 0 else 0.0,
            "steps": b["step"] - a["step"],
            "step_s": round(dt / (b["step"] - a["step"]), 3) if b["step"] > a["step"] else None, "pushes_accepted": pushed,
            "mean_lag_versions": round((lag[1] - lag[0]) / pushed, 2) if pushed else None,
            "skipped_slots": b["skipped_slots"] - a["skipped_slots"],
            "up_bytes_per_s": round((b["bytes_sent"] - a["bytes_sent"]) / dt) if dt > 0 else 0,
            "down_bytes_per_s": round((b["bytes_received"] - a["bytes_received"]) / dt) if dt > 0 else 0,
            "merges_not_received": outer - sum(b["versions"])}
    refused0, refused1 = s0.get("refused_by_outcome", {}), s1.get("refused_by_outcome", {})
    return {"seconds": round(e1[0]["t"] - e0[0]["t"], 1), "learners": rows,
            "merges": int(s1.get("outer_steps", 0)) - int(s0.get("outer_steps", 0)),
            "refused": {k: int(v) - int(refused0.get(k, 0)) for k, v in refused1.items() if int(v) != int(refused0.get(k, 0))}}


def rates(plan: dict[str, Any], scaled: int, step_s: float, share: float) -> dict[str, dict[str, float]]:
    """Per region, the scaled bytes/s both ways and the links: as given, and the least the plan accepts."""
    out = {}
    for r in plan["regions"]:
        up, down = wire_rates(scaled, plan["fragments"], r["learners"], step_s)
        ratio = r["link_bytes_per_s"] / max(r["up_bytes_per_s"], r["down_bytes_per_s"])  # the link over the need
        out[r["name"]] = {"up_bytes_per_s": up, "down_bytes_per_s": down,
                          "given_mbit": max(up, down) * ratio * 8 / 1e6, "planned_mbit": max(up, down) / share * 8 / 1e6}
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from diloco.apps.testkit import wan

    reason = wan.available()
    if reason:
        raise SystemExit(f"bench/plan_wan.py: {reason}")
    plan = plan_of(args.plan)
    if plan["shards"] != 1 or any(r["learners"] != 1 for r in plan["regions"]):
        raise SystemExit("bench/plan_wan.py: this bench runs one syncer shard and one learner a region; the plan has "
                         f"{plan['shards']} shard(s) and {[r['learners'] for r in plan['regions']]} learners")
    share = link_share(args.plan)
    tensors = plan["fragments"] * args.tensors_per_fragment
    layers = max(1, math.ceil((tensors - GPT_OTHER_TENSORS) / GPT_TENSORS_PER_LAYER))
    cfg = TransformerModel(layers=layers, d_model=args.d_model, heads=max(1, args.d_model // 64), context=CONTEXT)
    scaled = sum(math.prod(s) for s in (parameter_shapes(cfg) or {}).values())
    work = Path(tempfile.mkdtemp(prefix="diloco-plan-wan-"))
    config = work / "job.yaml"
    config.write_text(yaml.safe_dump(job(plan, layers, args.d_model, args.slowdown)))
    cache = Path(tempfile.gettempdir()) / "diloco-plan-wan-cache"  # compiled steps kept across runs
    env = dict(os.environ, DILOCO_TOKEN=secrets.token_hex(16), PYTHONUNBUFFERED="1", **CACHE_EVERY_PROGRAM,
               JAX_COMPILATION_CACHE_DIR=str(cache / "jax"), **{STEP_CACHE_ENV: str(cache / "step")})
    cpus = sorted(os.sched_getaffinity(0))
    names = [r["name"] for r in plan["regions"]]
    slow = min(plan["regions"], key=lambda r: r["link_bytes_per_s"])["name"]
    out: dict[str, Any] = {"bench": "plan_wan", "plan_args": args.plan, "fragments": plan["fragments"], "tau": plan["tau"],
                           "plan_step_s": plan["step_s"], "planned_params": plan["params"], "scaled_params": scaled,
                           "scaled_layers": layers, "d_model": args.d_model,
                           "fragmentation": FRAGMENTATION, "link_share": share, "slowdown": args.slowdown}
    real_floor = {r["name"]: max(r["up_bytes_per_s"], r["down_bytes_per_s"]) / share * 8 / 1e9 for r in plan["regions"]}
    given = {r["name"]: r["link_bytes_per_s"] * 8 / 1e9 for r in plan["regions"]}
    least = {n: least_link(args.plan, n, given[n], real_floor[n], plan["fragments"]) for n in names}
    out["least_accepted_gbps"] = {n: round(v, 3) for n, v in least.items()}
    print(f"plan_wan: P = {plan['fragments']}, tau = {plan['tau']}, {len(names)} regions, a {scaled:,}-parameter GPT "
          f"({layers} x {args.d_model}) for {plan['params']:.3g}", flush=True)
    with wan.Wan(names, mbit=None) as net:
        procs: list[subprocess.Popen[Any]] = []
        try:
            with open(work / "syncer.log", "w") as log:  # the child keeps its own copy of the descriptor
                procs.append(subprocess.Popen(net.argv("home", [sys.executable, "-P", "-m", "diloco.apps.cli", "syncer",
                                                                "--config", str(config), "--port", str(PORT),
                                                                "--checkpoint-dir", str(work / "ckpt")]),
                                              env=env, stdout=subprocess.DEVNULL, stderr=log, start_new_session=True,
                                              cwd=REPO))
            time.sleep(2.0)
            learners = [Learner(net, r["name"], i, cpus[(k + i) % len(cpus)], config, env)
                        for k, r in enumerate(plan["regions"]) for i in range(r["learners"])]
            procs += [ln.proc for ln in learners]
            deadline = time.time() + args.start_timeout
            while not all(ln.events for ln in learners):
                if time.time() > deadline or any(p.poll() is not None for p in procs):
                    raise SystemExit(f"bench/plan_wan.py: the learners did not start (logs in {work})")
                time.sleep(1.0)
            time.sleep(args.settle)
            windows = {"unthrottled": window(net, env, learners, args.seconds)}
            # The schedule's pace: a slot per step of its fastest learner.
            step = min(r["step_s"] for r in windows["unthrottled"]["learners"].values())
            link = rates(plan, scaled, step, share)
            out.update(bench_step_s=round(step, 4), links=link,
                       scale=round(scaled / plan["params"] * plan["step_s"] / step, 8))
            print(f"unthrottled: a slot every {step:.3f} s; links (Mbit/s) "
                  + ", ".join(f"{n} given {v['given_mbit']:.3f} planned {v['planned_mbit']:.3f}" for n, v in link.items()),
                  flush=True)
            shapes = {"given": {n: link[n]["given_mbit"] for n in names},
                      "planned": {n: link[n]["planned_mbit"] for n in names},
                      "half": {n: link[n]["planned_mbit"] / (2 if n == slow else 1) for n in names},
                      "accepted": {n: link[n]["given_mbit"] * least[n] / given[n] for n in names}}
            for name in args.windows.split(","):  # "planned*1.5": the planned links, 1.5x as fast
                base, _, times = name.partition("*")
                shaping = {n: v * float(times or 1) for n, v in shapes[base].items()}
                for region, mbit in shaping.items():
                    net.set_rate(region, mbit)
                time.sleep(args.settle)
                windows[name] = {"mbit": {n: round(v, 4) for n, v in shaping.items()},
                                 **window(net, env, learners, args.seconds)}
                print(json.dumps({name: windows[name]}), flush=True)
        finally:
            for p in procs[::-1]:
                if p.poll() is None:
                    os.killpg(p.pid, 15)
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, 9)
    base = windows["unthrottled"]["learners"]
    lagging = max(r["merges_not_received"] for r in base.values()) + plan["tau"]
    for w in windows.values():
        for region, row in w["learners"].items():
            row["of_unthrottled"] = round(row["tokens_per_s"] / base[region]["tokens_per_s"], 3)
            # The plan's bytes at the steps per second this window ran (CPU contention moves them).
            up, down = wire_rates(scaled, plan["fragments"], 1, row["step_s"] or math.inf)
            row["plan_need_mbit"] = round(max(up, down) * 8 / 1e6, 4)
            if "mbit" in w:
                row["link_over_need"] = round(w["mbit"][region] / row["plan_need_mbit"], 3)
            row["kept"] = (row["of_unthrottled"] >= 1 - TOLERANCE and row["pushes_accepted"] >= row["steps"] - plan["tau"]
                           and row["merges_not_received"] <= lagging and not w["refused"])
    out["windows"] = windows
    out["kept"] = {name: {region: r["kept"] for region, r in w["learners"].items()} for name, w in windows.items()}
    half_args = with_link(args.plan, slow, real_floor[slow] / 2)
    floor_args = args.plan
    for region, gbps in real_floor.items():
        floor_args = with_link(floor_args, region, gbps)
    out["plan_says"] = {"slow_region": slow, "real_floor_gbps": {n: round(v, 4) for n, v in real_floor.items()},
                        "planned_fixed_p": plan_says(f"{floor_args} --fragments {plan['fragments']}"),
                        "half": plan_says(half_args),
                        "half_fixed_p": plan_says(f"{half_args} --fragments {plan['fragments']}")}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", default=PLAN_12B_ONE_SHARD,
                        help="the arguments of `diloco plan` (default: the 12B x 4 regions plan of docs/PLANNING.md "
                             "at P = 192, its one-shard form)")
    parser.add_argument("--seconds", type=float, default=45.0, help="each window's measurement (45 s: ~40 slots)")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds after a link change before measuring")
    parser.add_argument("--slowdown", type=float, default=4.0,
                        help="each learner's step stretched by this (spec slowdown): 4 learners on a shared 2-core "
                             "machine, about a quarter of a core each (steps of 2.4-3 s here)")
    parser.add_argument("--windows", default="given,planned,half",
                        help="the shaped windows, in order; NAME*F: that window's links F times as fast")
    parser.add_argument("--d-model", type=int, default=D_MODEL, help="the scaled GPT's width")
    parser.add_argument("--tensors-per-fragment", type=int, default=TENSORS_PER_FRAGMENT,
                        help="the scaled GPT's depth: P x this many tensors")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds for every learner's first step")
    print(json.dumps(run(parser.parse_args())))


if __name__ == "__main__":
    main()
