"""The learner's model: one of the built-in families (trainer/models/gpt.py, trainer/models/llama.py) or the
user's own Flax module (`spec.model.module`), behind four functions every caller uses.

Parameter names are flat `a/b/c` paths; fragments, codecs and checkpoints all key on them,
and `embed`-prefixed tables are merged by plain averaging (docs/ALGORITHM.md, "The syncer":
Merge). Parameters are fp32 whatever `spec.model.dtype` says: that is the compute dtype.

Bring your own model: `module: "package.module:factory"`, where `factory(spec.model)`
returns a `flax.linen.Module` whose `__call__(tokens)` maps (batch, length) int32 token ids
to (batch, length, vocabSize) logits; name embedding tables `embed...` so they are averaged.
"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from diloco.shapes import parameter_shapes as spec_shapes
from diloco.spec import TransformerModel

if TYPE_CHECKING:  # Flax is imported where a module is built: a warm restart runs the exported
    import flax.linen as nn  # step (trainer/caches/step_cache.py) and never needs it (0.1-0.2 s of its start)

Params = dict[str, jax.Array]


def build(cfg: TransformerModel) -> nn.Module:
    """The Flax module `cfg` describes."""
    if cfg.module is not None:
        return _user_module(cfg)
    if cfg.family == "llama":
        from diloco.trainer.models.llama import Llama
        return Llama(cfg)
    from diloco.trainer.models.gpt import GPT
    return GPT(cfg)


def _user_module(cfg: TransformerModel) -> nn.Module:
    import flax.linen as nn

    assert cfg.module is not None
    where, _, name = cfg.module.partition(":")
    try:
        factory = getattr(importlib.import_module(where), name)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"spec.model.module {cfg.module!r}: cannot load it ({exc}); install the package "
                         "in the learner image and name an importable `package.module:factory`") from exc
    module = factory(cfg)
    if not isinstance(module, nn.Module):
        raise ValueError(f"spec.model.module {cfg.module!r}: the factory returned {type(module).__name__}, "
                         "not a flax.linen.Module")
    return module


def _flat(tree: Any) -> dict[str, Any]:
    from flax.traverse_util import flatten_dict

    return {"/".join(k): v for k, v in flatten_dict(tree).items()}


def init_params(cfg: TransformerModel, seed: int) -> Params:
    """Flat fp32 parameters; every learner gets the same ones from the same seed."""
    # Jitted: one compile instead of dozens of eagerly dispatched ops (3.6 s -> well under 1 s).
    variables = jax.jit(build(cfg).init)(jax.random.PRNGKey(seed), jnp.zeros((1, cfg.context), jnp.int32))
    return _flat(variables["params"])


def apply(cfg: TransformerModel, params: Params, tokens: jax.Array) -> jax.Array:
    """Logits (batch, length, vocabSize) in the compute dtype."""
    from flax.traverse_util import unflatten_dict

    nested = unflatten_dict({tuple(k.split("/")): v for k, v in params.items()})
    logits: jax.Array = build(cfg).apply({"params": nested}, tokens)  # type: ignore[assignment]  # no mutable collections: logits only
    return logits


def loss_fn(cfg: TransformerModel, params: Params, batch: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats (fp32 whatever the compute dtype); batch is
    (B, context + 1) token ids."""
    logits = apply(cfg, params, batch[:, :-1]).astype(jnp.float32)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch[:, 1:, None], axis=-1))


def shapes(params: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    return {k: tuple(int(d) for d in np.shape(v)) for k, v in params.items()}


@functools.lru_cache(maxsize=64)
def traced_shapes(cfg_json: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
    """What Flax's init makes, traced (no arrays computed): the truth diloco/shapes.py is checked against."""
    cfg = TransformerModel.model_validate_json(cfg_json)
    abstract = jax.eval_shape(build(cfg).init, jax.random.PRNGKey(0), jnp.zeros((1, cfg.context), jnp.int32))
    return tuple((k, tuple(v.shape)) for k, v in _flat(abstract["params"]).items())


def parameter_shapes(cfg: TransformerModel) -> dict[str, tuple[int, ...]]:
    """The model's parameter shapes without computing any: the built-in families' from the spec
    (diloco/shapes.py, what the operator sizes volumes with), a user's module's by tracing it."""
    known = spec_shapes(cfg)
    return known if known is not None else dict(traced_shapes(cfg.model_dump_json()))


def count(params: dict[str, Any]) -> int:
    return int(sum(np.prod(np.shape(v)) for v in params.values()))
