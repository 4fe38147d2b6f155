"""Decoupled DiLoCo in the deterministic replay harness (apps/sim/replay.py) with the real model.

    python bench/replay.py --arms decoupled,ablate-average --seeds 0,1,2
    python bench/replay.py --sweep-outer                  # outer lr x momentum for frequent syncs

One process per arm (two side by side, one per core), a virtual clock, scripted learner
speeds: the real learner books and schedule, the real round logic, merging and outer step,
the real int4 push codec and the real JAX model and inner step. Two runs of one arm and
seed are bit-for-bit the same, so an ablation's difference from its baseline is the knob
it turns plus the seed's noise, never timing. Every arm: M = 4 learners, the quickstart
model, the same shards, held-out windows and token budget as bench/quality.py.

Prints a table of mean ± std over the seeds; the last line is a JSON object.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arms
import common

# name -> (description, replay options); options: syncer (spec.syncer changes), scripts
# (timeline kind), adoption, shared (the shared schedule on/off).
ARMS: dict[str, tuple[str, dict[str, Any]]] = {
    "decoupled": ("the defaults: K=1, P=4 balanced, int4, RDA, token weighting, rebase, shared schedule", {}),
    "decoupled-chaos": ("... a learner killed every ~40 slots, back 10 slots later", {"scripts": "chaos"}),
    "ablate-chaos-fresh-moments": ("... a re-joining learner starts AdamW at zero moments, not a peer's",
                                   {"scripts": "chaos", "training": {"peerOptimizerState": False}}),
    "decoupled-slow": ("... one learner at half speed", {"scripts": "slow"}),
    "ablate-average": ("plain weighted average instead of RDA", {"syncer": {"merge": "average"}}),
    "ablate-no-token-weighting": ("uniform merge weights", {"syncer": {"tokenWeighting": False}}),
    "ablate-layer": ("by-layer fragments instead of balanced", {"syncer": {"fragmentation": "layer"}}),
    "ablate-bf16": ("bf16 outer gradients instead of int4", {"syncer": {"compression": "bf16"}}),
    "ablate-no-schedule": ("each learner picks its fragment from its own step count", {"shared": False}),
    "ablate-overwrite": ("adoption overwrites (θ_p ← Θ_p) instead of rebasing", {"adoption": "overwrite"}),
    "ablate-no-grace": ("no grace window (γ = 0): rounds close at quorum", {"syncer": {"graceWindow": {"gamma": 0.0}}}),
    "ablate-no-participation-scaling": ("partial rounds move Θ by their full merged update",
                                        {"syncer": {"participationScaling": False}}),
}


def scripts_for(kind: str, learners: int, steps: int, seed: int) -> list[Any]:
    """Learner timelines in units of one step: out of phase by a random fraction of a step."""
    import numpy as np

    from diloco.apps.sim.replay import Script

    rng = np.random.default_rng([seed, 7])
    starts = rng.random(learners) * 0.9
    scripts = [Script(start=float(s)) for s in starts]
    if kind == "slow":
        scripts[-1].step_seconds = 2.0
    elif kind == "chaos":  # like examples/chaos.yaml: kills every ~40 steps, back ~10 steps later
        t = 40.0
        while t < steps - 20:
            victim = int(rng.integers(learners))
            scripts[victim].outages.append((t + float(rng.random()), t + 10.0))
            t += float(rng.exponential(40.0))
    return scripts


class JaxTrainer:
    """The learner's real inner step (trainer/recipe.py) on each learner's real shard."""

    def __init__(self, m: dict[str, Any], learners: int) -> None:
        import numpy as np

        from diloco.spec import parse_job
        from diloco.trainer import data, model
        from diloco.trainer.recipe import Recipe

        spec = parse_job(m).spec
        self.np, self.data, self.spec = np, data, spec
        train, held_out = data.split(data.corpus_bytes(), spec.data.held_out_fraction)
        self.shards = [data.shard(train, i, learners, spec.data.sharding) for i in range(learners)]
        self.window = spec.model.context + 1
        self.tokens_per_step = spec.training.batch_size * spec.model.context
        self.evals = data.eval_batches(held_out, batches=spec.training.eval_batches, batch=spec.training.batch_size,
                                          length=self.window)
        self.recipe = Recipe(spec.model, spec.training)
        self.params0 = {k: np.array(v, np.float32) for k, v in model.init_params(spec.model, spec.data.seed).items()}
        # The learner's own data path (trainer/data.py Batches). A restarted learner continues its
        # shard where it was; the product resumes after the last merged batch, which re-trains
        # the few batches a kill lost (a difference of a few batches per kill).
        tr = spec.training
        self.batches = [data.Batches(s, tr.batch_size, self.window, seed=spec.data.seed, shard_index=i) for i, s in enumerate(self.shards)]
        self.taken = [0] * learners

    def fresh_state(self, m: int, params: dict[str, Any]) -> Any:
        return self.recipe.init_state(self.recipe.place(params))

    def step(self, m: int, params: dict[str, Any], state: Any, position: int) -> tuple[dict[str, Any], Any, int]:
        batch = self.batches[m].batch(self.taken[m])
        self.taken[m] += 1
        p, state, _ = self.recipe.step(self.recipe.place(params), state, batch, position)
        return {k: self.np.asarray(v) for k, v in p.items()}, state, self.tokens_per_step

    def eval_loss(self, params: dict[str, Any]) -> float:
        return self.recipe.eval_loss(self.recipe.place(params), self.evals)


def replay_arm(m: dict[str, Any], learners: int, steps: int, seed: int, scripts: str = "healthy",
               adoption: str = "rebase", shared: bool = True) -> dict[str, Any]:
    """One replayed run (called in a fresh process by arms.inproc)."""
    from diloco.apps.sim.replay import Replay
    from diloco.spec import parse_job

    spec = parse_job(m).spec
    trainer = JaxTrainer(m, learners)
    t0 = time.monotonic()
    replay = Replay(spec.syncer, trainer.params0, trainer, scripts_for(scripts, learners, steps, seed), steps=steps,
                    adoption=adoption, seed=seed, snapshot_every=steps / 6,
                    peer_state=spec.training.peer_optimizer_state)
    if not shared:
        replay.schedule_factory = lambda num, slot, m: _Unshared(num, m)  # type: ignore[attr-defined]
    r = replay.run()
    tps = spec.training.batch_size * spec.model.context
    curve = [(slot * tps * learners, trainer.eval_loss(params)) for _, slot, params in r.curve[1:]]
    final = trainer.eval_loss(r.params)
    return {"final_eval_loss": final, "tokens": r.tokens_trained, "tokens_merged": r.tokens_merged,
            "outer_steps": r.outer_steps, "mean_round": sum(r.rounds) / max(len(r.rounds), 1),
            "skipped_slots": r.skipped_slots, "refused": r.refused, "wall_seconds": time.monotonic() - t0,
            "curve": curve + [(r.tokens_trained, final)]}


class _Unshared:
    """The ablation: fragment from the learner's own step count (offset by its index), deaf to the syncer."""

    def __init__(self, num: int, m: int) -> None:
        from diloco.core.schedule import Schedule

        self.inner = Schedule(num, 0)
        self.offset, self.num = m, num

    @property
    def slot(self) -> int:
        return self.inner.slot

    @property
    def skipped(self) -> int:
        return 0

    def take(self) -> tuple[int, range]:
        slot, _ = self.inner.take()
        p = (slot + self.offset) % self.num
        return slot, range(p, p + 1)

    def observe(self, next_slot: int) -> int:
        return 0

    def skip(self, slots: int = 1) -> None:
        pass

    def late(self, fragment: int) -> None:
        pass


def arm_manifest(args: argparse.Namespace, change: dict[str, Any], seed: int, lr: float | None = None,
                 outer: tuple[float, float] | None = None) -> dict[str, Any]:
    syncer = common.deep(change.get("syncer") or {})
    if outer:
        syncer.update(outerLearningRate=outer[0], outerMomentum=outer[1])
    training = {**change.get("training", {}), **({"learningRate": lr} if lr else {})} or None
    m = common.manifest("replay", steps_per_learner=args.steps, syncer=syncer, seed=seed, training=training,
                        groups=[{"name": "local", "replicas": args.learners}])
    m["spec"]["data"]["sharding"] = args.sharding
    return m


def run_grid(jobs: list[tuple[str, dict[str, Any], dict[str, Any]]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i in range(0, len(jobs), 2):
        pair = jobs[i:i + 2]
        handles = [arms.inproc_async("replay", m, cpu, **kw) for cpu, (_, m, kw) in enumerate(pair)]
        for (name, _, kw), h in zip(pair, handles):
            r = h.result()
            r.update(arm=name, seed=kw["seed"])
            rows.append(r)
            print(f"{name} seed {kw['seed']}: final loss {r['final_eval_loss']:.4f} "
                  f"(rounds of {r['mean_round']:.2f}, {r['skipped_slots']} skipped, {r['wall_seconds']:.0f} s)",
                  flush=True)
    return rows


def summarise(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    import numpy as np

    out: dict[str, dict[str, float]] = {}
    for name in dict.fromkeys(r["arm"] for r in rows):
        vals = [r["final_eval_loss"] for r in rows if r["arm"] == name]
        out[name] = {"mean": float(np.mean(vals)), "std": float(np.std(vals, ddof=1)) if len(vals) > 1 else 0.0,
                     "n": len(vals)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300, help="schedule slots (inner steps per learner)")
    parser.add_argument("--learners", type=int, default=4)
    parser.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    parser.add_argument("--arms", default="decoupled", help=f"comma list from {sorted(ARMS)} or 'all'")
    parser.add_argument("--lr", type=float, help="inner learning rate (default: the bench's 3e-3)")
    parser.add_argument("--sharding", choices=["contiguous", "interleaved"], default="contiguous")
    parser.add_argument("--sweep-outer", action="store_true", help="outer lr x momentum grid on the decoupled arm")
    parser.add_argument("--outer-lrs", type=lambda s: [float(x) for x in s.split(",")], default=[1.0, 1.3, 1.5, 2.0])
    parser.add_argument("--outer-momenta", type=lambda s: [float(x) for x in s.split(",")], default=[0.0, 0.5, 0.9])
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=common.RUNS / "replay" / "result.json")
    args = parser.parse_args()
    if args.smoke:
        common.use_smoke_model()
        args.steps, args.seeds = 24, [0]
        args.out = common.RUNS / "smoke" / "replay" / "result.json"
    t0 = time.monotonic()
    jobs: list[tuple[str, dict[str, Any], dict[str, Any]]] = []
    base_kw = {"learners": args.learners, "steps": args.steps}
    if args.sweep_outer:
        for lr in args.outer_lrs:
            for mu in args.outer_momenta:
                for seed in args.seeds:
                    jobs.append((f"outer-lr{lr:g}-mu{mu:g}", arm_manifest(args, {}, seed, args.lr, (lr, mu)),
                                 {**base_kw, "seed": seed}))
    else:
        names = list(ARMS) if args.arms == "all" else args.arms.split(",")
        unknown = [n for n in names if n not in ARMS]
        if unknown:
            parser.error(f"unknown arms {unknown}; choose from {sorted(ARMS)}")
        for name in names:
            change = ARMS[name][1]
            opts = {k: change[k] for k in ("scripts", "adoption", "shared") if k in change}
            for seed in args.seeds:
                jobs.append((name, arm_manifest(args, change, seed, args.lr), {**base_kw, "seed": seed, **opts}))
    rows = run_grid(jobs)
    stats = summarise(rows)
    print(f"\nreplay, M = {args.learners}, {args.steps} slots, seeds {args.seeds}, inner lr {args.lr or 3e-3:g}, "
          f"{args.sharding} shards")
    print(common.table([{"arm": k, **v} for k, v in stats.items()],
                       [("arm", "arm", ""), ("mean", "final loss (mean)", ".4f"), ("std", "std", ".4f"),
                        ("n", "seeds", "d")]))
    common.save_json(args.out, rows)
    common.emit({"bench": "replay", "learners": args.learners, "steps": args.steps, "seeds": args.seeds,
                 "inner_lr": args.lr or 3e-3, "sharding": args.sharding, "arms": stats, "seconds": round(time.monotonic() - t0, 1)})


if __name__ == "__main__":
    main()
