"""The one training recipe: the model's loss, AdamW, its learning-rate schedule and the
held-out eval, as the learner, every benchmark and the run report use them.

AdamW with global-norm clipping; the learning rate follows linear warmup then cosine decay
and is passed in each step at a schedule position the caller keeps (the learner: the job's
trained tokens in steps of one learner, diloco/core/schedule.py JobProgress), so a learner
that (re)joins mid-job resumes the job's schedule instead of warming up again (AdamW's own
bias correction restarts with its moments, as it must). With a `Layout` (trainer/sharding.py) the step runs
as one SPMD program over the learner's mesh; without one, on the default device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from diloco.spec import Training, TransformerModel
from diloco.trainer import model
from diloco.trainer.caches import step_cache
from diloco.trainer.sharding import Layout


def scalar(x: jax.Array) -> float:
    """A replicated scalar as a Python float, also when its devices span several processes."""
    return float(np.asarray(x.addressable_data(0)))


def learning_rate(tr: Training) -> Callable[[int], float]:
    """The learning rate at a schedule position: linear warmup from 0 to the peak over
    warmupSteps, then a cosine to peak x minLrRatio at decaySteps (optax's
    `warmup_cosine_decay_schedule`, its formula on Python floats). optax's schedule is a dozen
    eager JAX operations, each a small compiled program: a restarted learner loaded them all from
    the compilation cache, half a second of its CPU (a quarter of a chaos restart's)."""
    peak, warmup, alpha = tr.learning_rate, tr.warmup_steps, tr.min_lr_ratio
    span = max(1, tr.decay_steps - warmup)  # the job spec keeps warmup below decay

    def lr(position: int) -> float:
        step = max(0, int(position))
        if step < warmup:
            return peak * step / warmup
        done = min(step - warmup, span) / span
        return peak * ((1.0 - alpha) * 0.5 * (1.0 + math.cos(math.pi * done)) + alpha)

    return lr


def optimizer(tr: Training) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(tr.grad_clip),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=tr.weight_decay))


class Recipe:
    """`init` -> (params, state); `step(params, state, batch, slot)` -> (params, state, loss);
    `eval_loss(params, batches)`. Parameters and state stay where the layout puts them."""

    def __init__(self, cfg: TransformerModel, tr: Training, layout: Layout | None = None, *,
                 shapes: dict[str, tuple[int, ...]] | None = None, cache_dir: str | None = None) -> None:
        """`shapes`: the parameters' shapes where the caller has them (a learner, from Θ₀);
        without them the model's init is traced once more (0.1 s of a restart's CPU).
        `cache_dir`: JAX's compilation cache, where a learner keeps its lowered train step
        (trainer/caches/step_cache.py), so a restart neither traces nor lowers it again."""
        self.cfg, self.tr, self.layout = cfg, tr, layout
        self._param_shapes = shapes
        self.tx = optimizer(tr)
        self.lr = learning_rate(tr)

        def grads(params: Any, batch: Any) -> Any:
            return jax.value_and_grad(lambda p: model.loss_fn(cfg, p, batch))(params)

        def update(params: Any, state: Any, grads: Any, lr: Any) -> Any:
            clip_state, adamw_state = state
            adamw_state.hyperparams["learning_rate"] = lr
            updates, state = self.tx.update(grads, (clip_state, adamw_state), params)
            return optax.apply_updates(params, updates), state

        def step(params: Any, state: Any, batch: Any, lr: Any) -> Any:
            loss, g = grads(params, batch)
            return (*update(params, state, g, lr), loss)

        # Apart, for data-parallel baselines that all-reduce gradients between the two.
        self._grads, self._update = jax.jit(grads), jax.jit(update)

        loss = lambda p, b: model.loss_fn(cfg, p, b)  # noqa: E731
        if layout is None:
            self._step, self._loss, self._init = jax.jit(step), jax.jit(loss), jax.jit(self.tx.init)
            self.host_args = True
            return
        state_shapes = jax.eval_shape(self.tx.init, self._shapes())
        state_sh = layout.state_shardings(state_shapes)
        # In-shardings let the step take a host batch (and host parameters) straight through
        # jit's C++ argument handling: a separate device_put of the batch costs 0.3 ms of a
        # 60 ms CPU step, with the caches cold from the step before.
        in_sh, out_sh = (layout.params, state_sh, layout.batch, layout.replicated), (layout.params, state_sh, layout.replicated)
        self._step = jax.jit(step, in_shardings=in_sh, out_shardings=out_sh)
        self.host_args = not layout.mesh.is_multi_process  # across processes jit refuses host arrays
        self._loss = jax.jit(loss, out_shardings=layout.replicated)
        self._init = jax.jit(self.tx.init, out_shardings=state_sh)
        if cache_dir is not None and self.host_args and cfg.module is None:
            batch = jax.ShapeDtypeStruct((tr.batch_size, cfg.context + 1), jnp.int32)
            settings = {"model": cfg.model_dump(mode="json"), "training": tr.model_dump(mode="json")}
            example = (self._shapes(), state_shapes, batch, jax.ShapeDtypeStruct((), jnp.float32))
            self._step = step_cache.cached("step", step, example, shardings=in_sh, out_shardings=out_sh,
                                           out_like=(self._shapes(), state_shapes, 0.0), spec=settings,
                                           cache_dir=cache_dir)
            self._loss = step_cache.cached("loss", loss, (self._shapes(), batch), shardings=(layout.params, layout.batch),
                                           out_shardings=layout.replicated, out_like=0.0, spec=settings,
                                           cache_dir=cache_dir)

    def _shapes(self) -> dict[str, Any]:
        shapes = self._param_shapes if self._param_shapes is not None else model.parameter_shapes(self.cfg)
        return {n: jax.ShapeDtypeStruct(s, jnp.float32) for n, s in shapes.items()}

    def place(self, params: dict[str, Any]) -> dict[str, jax.Array]:
        """Host arrays as the step's parameters (sharded over the mesh, or on the device)."""
        if self.layout is None:
            return {n: jnp.asarray(v) for n, v in params.items()}
        return self.layout.put_params(params)

    def shift(self, params: dict[str, jax.Array], by: dict[str, Any]) -> dict[str, jax.Array]:
        """The parameters named in `by`, plus its host arrays: an adoption's rebase (core/ledger.py)."""
        if self.layout is None:
            return {n: params[n] + jnp.asarray(v) for n, v in by.items()}
        return self.layout.add_params(params, by)

    def init_state(self, params: dict[str, jax.Array]) -> Any:
        return self._init(params)

    def _batch(self, batch: np.ndarray) -> jax.Array:
        return jnp.asarray(batch) if self.layout is None else self.layout.put_batch(batch)

    def step(self, params: Any, state: Any, batch: np.ndarray, position: int) -> tuple[Any, Any, jax.Array]:
        out: tuple[Any, Any, jax.Array] = self._step(params, state, batch if self.host_args else self._batch(batch),
                                                     self.lr(position))
        return out

    def grads(self, params: Any, batch: np.ndarray) -> tuple[jax.Array, Any]:
        """(loss, gradients) without updating: what a data-parallel worker all-reduces."""
        out: tuple[jax.Array, Any] = self._grads(params, self._batch(batch))
        return out

    def update(self, params: Any, state: Any, grads: Any, slot: int) -> tuple[Any, Any]:
        out: tuple[Any, Any] = self._update(params, state, grads, self.lr(slot))
        return out

    def batch_loss(self, params: Any, batch: np.ndarray) -> jax.Array:
        out: jax.Array = self._loss(params, self._batch(batch))
        return out

    def eval_loss(self, params: Any, batches: Iterable[np.ndarray]) -> float:
        """Mean held-out loss over fixed batches (one compiled forward pass, reused)."""
        return float(np.mean([scalar(self.batch_loss(params, b)) for b in batches]))
