"""The learner's inner optimizer and step, shared by the learner and the replay harness.

AdamW with global-norm clipping; the learning rate follows linear warmup then cosine
decay over the *shared schedule's* slots and is passed in each step, so a learner that
(re)joins mid-job resumes the job's schedule instead of warming up again (AdamW's own
bias correction restarts with its moments, as it must).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax

from diloco.spec import Training, TransformerModel
from diloco.trainer import model


def learning_rate(tr: Training) -> Callable[[int], float]:
    schedule = optax.warmup_cosine_decay_schedule(
        0.0, tr.learning_rate, tr.warmup_steps, tr.decay_steps, tr.learning_rate * tr.min_lr_ratio)
    return lambda slot: float(schedule(slot))


def optimizer(tr: Training) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(tr.grad_clip),
                       optax.inject_hyperparams(optax.adamw)(learning_rate=0.0, weight_decay=tr.weight_decay))


def train_step(cfg: TransformerModel, tx: optax.GradientTransformation) -> Callable[..., Any]:
    """A jitted `(params, opt_state, batch, lr) -> (params, opt_state, loss)`."""

    @jax.jit
    def step(params: Any, opt_state: Any, batch: Any, lr: Any) -> Any:
        clip_state, adamw_state = opt_state
        adamw_state.hyperparams["learning_rate"] = lr
        loss, grads = jax.value_and_grad(lambda p: model.loss_fn(cfg, p, batch))(params)
        updates, opt_state = tx.update(grads, (clip_state, adamw_state), params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step
