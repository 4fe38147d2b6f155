"""A plan's WAN checked: each region's learner over a link shaped at its planned rate, scaled down.

    sudo nice -n 10 python bench/plan_wan.py [--plan "ARGS of diloco plan" | NAME] [--windows given,planned,half]
                                             [--seconds 45] [--slowdown 4]

Runs `diloco plan ARGS --json`, then the real `diloco syncer` (in a "home" network namespace:
the plan's shards, N `diloco syncer --shard i` processes on ports 50200 + i, when it plans more
than one) and one real `diloco learner` a region (`--syncer` every shard's address), each in its
own namespace behind a veth link shaped with tbf both ways (apps/testkit/wan.py), over a small
GPT of P x N tensors (the plan's P, N and tau, the plan's codecs: int4 pushes and deltas back).
`--plan` also takes a name: 12b-one-shard (the default: the 12B x 4 regions plan at P = 192,
one shard), 12b (the same plan as `diloco plan` makes it: 4 shards at P = 48, 8 processes), or
2e9-two-shards (2B over 2 regions: 2 shards at P = 24, 4 processes, for a machine with too few
cores for 8; its 6-layer GPT steps in ~0.1 s at slowdown 4: give `--slowdown 40` for 1-2.5 s
steps, as the 12B plan's). The plan's bytes are the total over its shards (each step pushes one fragment to
each shard), so a region's link carries them all. A region's bytes/s scale from the plan's by the model's ratio
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

- unshaped: the links unshaped again (the load's reference at the end: `of_unthrottled` is
  against the first window).

With `--pace track`, every link follows the learners' pace: every 3 s it is set to its
window's shape at the fastest learner's step over the last 9 s. A shared machine's load moves
the pace (and the slowdown stretches every move fourfold); a link scaled to the unthrottled
pace is short of the plan's bytes when the learners later run faster. A window's `mbit` is
then each link's time-weighted mean, `paced_step_s` the range of paces it was set to.

It also asks `diloco plan` (real size, P fixed and free) about the planned links and the half one.
Per learner and window: tokens/s against its unthrottled, steps, pushes accepted (the syncer's
Status), pushes refused, the mean version lag of its accepted pushes, slots skipped (a push
later than its slot's close moves a learner's schedule on), and how many merges it had not
yet received at the window's end; sharded, also each shard's pushes accepted. Last line: JSON.
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

PORT = 50200  # shard i listens on PORT + i in the home namespace; nothing else listens there
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
# The 12B x 4 plan keeps its 4 shards at P = 48 (issue 63); at P = 192 it plans the one shard it
# had when folded (a quarter of the bytes a region), which docs/PLANNING.md's WAN rows measured.
PLAN_12B_ONE_SHARD = PLAN_12B + " --fragments 192"
# A smaller sharded plan for a machine too small for the 12B plan's 4 shards and 4 learners: 2B
# over two regions (5 and 2 Gbit/s, as two of the 12B plan's) plans 2 shards at P = 24.
PLAN_2E9_TWO_SHARDS = ("--params 2e9 --tau 3 --region name=us-central,learners=1,wan-gbps=5,latency-ms=5 "
                       "--region name=us-east,learners=1,wan-gbps=2,latency-ms=20")
PLANS = {"12b-one-shard": PLAN_12B_ONE_SHARD, "12b": PLAN_12B, "2e9-two-shards": PLAN_2E9_TWO_SHARDS}


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
            "syncer": {"fragments": plan["fragments"], "shards": plan["shards"], "fragmentation": FRAGMENTATION,
                       "compression": F.UP_CODEC,
                       "broadcastCompression": F.DOWN_CODEC,  # the codecs the plan's rates are for
                       "graceWindow": {"tau": plan["tau"]}, "checkpointIntervalSeconds": 100000},
            "model": {"layers": layers, "dModel": d_model, "heads": max(1, d_model // 64), "context": CONTEXT},
            "training": {"batchSize": BATCH, "warmupSteps": 20, "decaySteps": 100000, "evalIntervalSteps": 1000000},
        },
    }


def addresses(host: str, shards: int) -> list[str]:
    """Every shard's address from `host` (a region's view of home, or home's own 127.0.0.1)."""
    return [f"{host}:{PORT + i}" for i in range(shards)]


def syncer_argv(config: Path, work: Path, shard: int, shards: int) -> list[str]:
    """One syncer shard's process (the whole syncer when unsharded), each with its own checkpoint
    directory (a directory is one shard's volume). Not pinned: the kernel places the shards
    beside the learners, which are (a shard pinned beside a learner would starve one of them
    while the other core idles, as bench/syncer_scale.py found)."""
    return [sys.executable, "-P", "-m", "diloco.apps.cli", "syncer", "--config", str(config), "--port", str(PORT + shard),
            "--checkpoint-dir", str(work / "ckpt" / f"shard-{shard}"), *(["--shard", str(shard)] if shards > 1 else [])]


def learner_argv(config: Path, region: str, index: int, syncers: list[str], cpu: int) -> list[str]:
    """One learner: every shard's address in shard order, pinned to its core (`--cpus`)."""
    return [sys.executable, "-P", "-m", "diloco.apps.cli", "learner", "--config", str(config), "--group", region,
            "--index", str(index), "--syncer", ",".join(syncers), "--cpus", str(cpu)]


class Learner:
    """One `diloco learner` in its region's namespace; its progress events, as they come."""

    def __init__(self, net: Any, region: str, index: int, cpu: int, config: Path, env: dict[str, str], shards: int):
        self.region, self.events, self.name = region, list[dict[str, Any]](), f"{region}-{index}"
        argv = learner_argv(config, region, index, addresses(net.links[region].home_ip, shards), cpu)
        with open(config.parent / f"learner-{self.name}.log", "w") as log:  # the child keeps its own copy
            self.proc = subprocess.Popen(net.argv(region, argv), env=env, stdout=subprocess.PIPE,
                                         stderr=log, text=True, start_new_session=True, cwd=REPO)
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


def status(net: Any, env: dict[str, str], shards: int) -> dict[str, Any]:
    """The syncer's status: every shard's added up, each shard's own under `per_shard` (`diloco status`)."""
    argv = [sys.executable, "-P", "-m", "diloco.apps.cli", "status", "--syncer", ",".join(addresses("127.0.0.1", shards))]
    out = subprocess.run(net.argv("home", argv), env=env, capture_output=True, text=True, cwd=REPO)
    got = dict(json.loads(out.stdout))
    got.setdefault("per_shard", [got])
    return got


def contributions(s: dict[str, Any], region: str) -> int:
    return int({x["region"]: x for x in s.get("learners", [])}.get(region, {}).get("contributions", 0))


def window(net: Any, env: dict[str, str], learners: list[Learner], seconds: float, shards: int) -> dict[str, Any]:
    """Every learner's figures over `seconds` from now."""
    s0, e0 = status(net, env, shards), [ln.last() for ln in learners]
    time.sleep(seconds)
    e1 = [ln.last() for ln in learners]
    s1 = status(net, env, shards)
    outer = sum(int(v) for v in s1.get("versions", []))
    rows = {}
    for ln, a, b in zip(learners, e0, e1, strict=True):
        dt = b["t"] - a["t"]
        # Each step pushes one fragment to each shard: a learner keeps up when every shard accepts
        # its pushes, so its figure is the fewest any shard accepted (one shard: the syncer's count).
        by_shard = [contributions(y, ln.region) - contributions(x, ln.region)
                    for x, y in zip(s0["per_shard"], s1["per_shard"], strict=True)]
        pushed = sum(by_shard)
        regions = [{x["region"]: x for x in s.get("regions", [])}.get(ln.region, {}) for s in (s0, s1)]
        lag = [float(r.get("mean_staleness", 0)) * int(r.get("contributions", 0)) for r in regions]
        rows[ln.region] = {
            "tokens_per_s": round((b["trained_tokens"] - a["trained_tokens"]) / dt, 1) if dt > 0 else 0.0,
            "steps": b["step"] - a["step"],
            "step_s": round(dt / (b["step"] - a["step"]), 3) if b["step"] > a["step"] else None,
            "pushes_accepted": min(by_shard), **({"pushes_accepted_by_shard": by_shard} if shards > 1 else {}),
            "mean_lag_versions": round((lag[1] - lag[0]) / pushed, 2) if pushed else None,
            "skipped_slots": b["skipped_slots"] - a["skipped_slots"],
            "up_bytes_per_s": round((b["bytes_sent"] - a["bytes_sent"]) / dt) if dt > 0 else 0,
            "down_bytes_per_s": round((b["bytes_received"] - a["bytes_received"]) / dt) if dt > 0 else 0,
            "merges_not_received": outer - sum(b["versions"])}
    refused0, refused1 = s0.get("refused_by_outcome", {}), s1.get("refused_by_outcome", {})
    return {"seconds": round(e1[0]["t"] - e0[0]["t"], 1), "learners": rows,
            "merges": int(s1.get("outer_steps", 0)) - int(s0.get("outer_steps", 0)),
            "refused": {k: int(v) - int(refused0.get(k, 0)) for k, v in refused1.items() if int(v) != int(refused0.get(k, 0))}}


class Pacer:
    """Each region's link at its window's shape, scaled to a pace. `track`: every `every` seconds to
    the learners' pace now (the fastest learner's step over the last `span` seconds), so a link
    stays the plan's bytes at the pace the learners run while a shared machine's load moves it;
    else the unthrottled window's pace throughout. Every rate set is kept to average a window's."""

    def __init__(self, net: Any, learners: list[Learner], step: float, track: bool, every: float = 3.0,
                 span: float = 9.0):
        self.net, self.learners, self.step, self.track, self.every, self.span = net, learners, step, track, every, span
        self.shape: dict[str, float] | None = None  # Mbit/s at pace `step`; None: unshaped
        self.factor, self.log = 1.0, list[tuple[float, float, dict[str, float]]]()  # (t, pace, Mbit/s)
        self.lock, self.done = threading.Lock(), threading.Event()
        if track:
            threading.Thread(target=self._loop, daemon=True).start()

    def pace(self) -> float:
        now, got = time.time(), []
        for ln in self.learners:
            recent = [e for e in ln.events[-64:] if e["t"] >= now - self.span]
            if len(recent) >= 2 and recent[-1]["step"] > recent[0]["step"]:
                got.append((recent[-1]["t"] - recent[0]["t"]) / (recent[-1]["step"] - recent[0]["step"]))
        return min(got) if got else math.inf

    def set(self, shape: dict[str, float] | None) -> None:
        with self.lock:
            self.shape = shape
            self._apply(force=True)

    def _apply(self, force: bool = False) -> None:
        paced = self.pace() if self.track else self.step
        if math.isfinite(paced) and (force or abs(self.step / paced / self.factor - 1) > 0.03):
            self.factor = self.step / paced
        elif not force:
            paced = self.step / self.factor
        rates = {n: v * self.factor for n, v in (self.shape or {}).items()}
        for region in self.net.links:
            if self.shape is None:
                self.net.unshape(region)
            else:
                self.net.set_rate(region, rates[region])
        self.log.append((time.time(), self.step / self.factor, rates))

    def _loop(self) -> None:
        while not self.done.wait(self.every):
            with self.lock:
                if self.shape is not None:
                    self._apply()

    def over(self, t0: float, t1: float) -> dict[str, Any]:
        """The links over [t0, t1]: each region's mean Mbit/s (time-weighted) and the paces used."""
        with self.lock:
            log = [x for x in self.log if x[0] < t1]
        inside = [x for x in log if x[0] >= t0]
        before = [x for x in log if x[0] < t0][-1:]
        spans = before + inside
        if not spans or not spans[-1][2]:
            return {}
        ends = [max(t0, x[0]) for x in spans[1:]] + [t1]
        starts = [max(t0, x[0]) for x in spans]
        total = sum(b - a for a, b in zip(starts, ends, strict=True)) or 1.0
        mean = {n: sum(x[2][n] * (b - a) for x, a, b in zip(spans, starts, ends, strict=True)) / total
                for n in spans[-1][2]}
        paces = [x[1] for x in spans]
        return {"mbit": {n: round(v, 4) for n, v in mean.items()},
                "paced_step_s": [round(min(paces), 3), round(max(paces), 3)], "rate_changes": len(inside)}


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
    if any(r["learners"] != 1 for r in plan["regions"]):
        raise SystemExit("bench/plan_wan.py: this bench runs one learner a region; the plan has "
                         f"{[r['learners'] for r in plan['regions']]}")
    shards = int(plan["shards"])
    share = link_share(args.plan)
    tensors = plan["fragments"] * shards * args.tensors_per_fragment  # P per shard
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
    out: dict[str, Any] = {"bench": "plan_wan", "plan_args": args.plan, "fragments": plan["fragments"],
                           "shards": shards, "tau": plan["tau"],
                           "plan_step_s": plan["step_s"], "planned_params": plan["params"], "scaled_params": scaled,
                           "scaled_layers": layers, "d_model": args.d_model,
                           "fragmentation": FRAGMENTATION, "link_share": share, "slowdown": args.slowdown}
    real_floor = {r["name"]: max(r["up_bytes_per_s"], r["down_bytes_per_s"]) / share * 8 / 1e9 for r in plan["regions"]}
    given = {r["name"]: r["link_bytes_per_s"] * 8 / 1e9 for r in plan["regions"]}
    least = {n: least_link(args.plan, n, given[n], real_floor[n], plan["fragments"]) for n in names}
    out["least_accepted_gbps"] = {n: round(v, 3) for n, v in least.items()}
    print(f"plan_wan: P = {plan['fragments']} x {shards} shard(s), tau = {plan['tau']}, {len(names)} regions, "
          f"a {scaled:,}-parameter GPT "
          f"({layers} x {args.d_model}) for {plan['params']:.3g}", flush=True)
    with wan.Wan(names, mbit=None) as net:
        procs: list[subprocess.Popen[Any]] = []
        try:
            for shard in range(shards):
                with open(work / f"syncer-{shard}.log", "w") as log:  # the child keeps its own copy of the descriptor
                    procs.append(subprocess.Popen(net.argv("home", syncer_argv(config, work, shard, shards)), env=env,
                                                  stdout=subprocess.DEVNULL, stderr=log, start_new_session=True, cwd=REPO))
            time.sleep(2.0 + shards)
            learners = [Learner(net, r["name"], i, cpus[(k + i) % len(cpus)], config, env, shards)
                        for k, r in enumerate(plan["regions"]) for i in range(r["learners"])]
            procs += [ln.proc for ln in learners]
            deadline = time.time() + args.start_timeout
            while not all(ln.events for ln in learners):
                gone = [" ".join(map(str, p.args[8:])) for p in procs if p.poll() is not None]
                if time.time() > deadline or gone:
                    raise SystemExit(f"bench/plan_wan.py: the learners did not start (logs in {work}; exited: {gone})")
                time.sleep(1.0)
            time.sleep(args.settle)
            windows = {"unthrottled": window(net, env, learners, args.seconds, shards)}
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
            pacer = Pacer(net, learners, step, track=args.pace == "track")
            try:
                for name in args.windows.split(","):  # "planned*1.5": the planned links, 1.5x as fast
                    base, _, times = name.partition("*")
                    pacer.set(None if base == "unshaped" else
                              {n: v * float(times or 1) for n, v in shapes[base].items()})
                    time.sleep(args.settle)
                    t0 = time.time()
                    got = window(net, env, learners, args.seconds, shards)
                    windows[name] = {**pacer.over(t0, time.time()), **got}
                    print(json.dumps({name: windows[name]}), flush=True)
            finally:
                pacer.done.set()
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
    # tau slots' merges more than unthrottled: a slot merges one fragment on each shard
    lagging = max(r["merges_not_received"] for r in base.values()) + plan["tau"] * shards
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
    parser.add_argument("--plan", default="12b-one-shard",
                        help="the arguments of `diloco plan`, or a name: 12b-one-shard (the default: the 12B x 4 "
                             "regions plan of docs/PLANNING.md at P = 192, one shard), 12b (that plan's own 4 shards "
                             "at P = 48), 2e9-two-shards (2B x 2 regions: 2 shards at P = 24; with --slowdown 40)")
    parser.add_argument("--seconds", type=float, default=45.0, help="each window's measurement (45 s: ~40 slots)")
    parser.add_argument("--settle", type=float, default=15.0, help="seconds after a link change before measuring")
    parser.add_argument("--slowdown", type=float, default=4.0,
                        help="each learner's step stretched by this (spec slowdown): 4 learners on a shared 2-core "
                             "machine, about a quarter of a core each (steps of 2.4-3 s here)")
    parser.add_argument("--windows", default="given,planned,half",
                        help="the shaped windows, in order; NAME*F: that window's links F times as fast")
    parser.add_argument("--pace", choices=("unthrottled", "track"), default="unthrottled",
                        help="the step the links are scaled to: the unthrottled window's fastest (the default), or "
                             "`track`: every 3 s the fastest learner's over the last 9 s (a shared machine's load "
                             "moves the learners' pace, and the slowdown stretches every move fourfold)")
    parser.add_argument("--d-model", type=int, default=D_MODEL, help="the scaled GPT's width")
    parser.add_argument("--tensors-per-fragment", type=int, default=TENSORS_PER_FRAGMENT,
                        help="the scaled GPT's depth: P x this many tensors")
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds for every learner's first step")
    args = parser.parse_args()
    args.plan = PLANS.get(args.plan, args.plan)
    print(json.dumps(run(args)))


if __name__ == "__main__":
    main()
