"""The base every spec class shares (diloco/spec.py, diloco/spec_learner.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class Model(BaseModel):
    """Strict base: camelCase in manifests, snake_case in Python, unknown fields refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)
