"""The base every spec class shares, and the patterns their names follow (diloco/spec*.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class Model(BaseModel):
    """Strict base: camelCase in manifests, snake_case in Python, unknown fields refused."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


# Kubernetes names and a syncer's address, as the API server checks them.
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
HOST_PORT = r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}$"
# One shard's address, or its two members' (the active syncer and a standby in another
# cluster), `host:port|host:port`, tried in turn (diloco.contract.ALTERNATE).
ALTERNATES = r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5}(\|(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.-]+):[0-9]{1,5})?$"
