"""One replayed run with the real model, in a process of its own (bench/replay.py's arms, started
through bench/arms.py's `inproc replay`): the learner timelines, the JAX trainer the replay
steps, and the ablation without a shared schedule. Apart from bench/replay.py so the child's
entry point does not import the grid that starts it."""

from __future__ import annotations

import time
from typing import Any


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
        # The learner's own data path (trainer/data/__init__.py Batches). A restarted learner continues its
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
