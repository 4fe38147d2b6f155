"""The validating admission webhook: `kubectl apply` refuses what the operator would fail.

The API server asks before it stores a DecoupledDiLoCoJob (create, and update of the object
itself: the status subresource is not asked). The answer runs the operator's own code: the
parse and spec checks of `passes.load` and the install checks that `reconcile` runs next
(`spec_checks.install_problems`, with the chart's settings), so a refusal says word for word
what the job's InvalidSpec condition and `diloco validate` would. The one check that needs the
cluster (a running syncer's shard count) stays the operator's. An update is refused only
when it adds a problem: kopf's own patches (its finalizer, annotations) to a job that was
stored invalid (before the webhook existed, or while it was down with failurePolicy Ignore),
and its deletion, still go through. Jobs another controller runs (spec.managedBy) are not
checked, as the operator does not load them. kopf serves it (`settings.admission.server`),
in every replica, the standby too; the chart's ValidatingWebhookConfiguration points at it
and operator/admission/certificates.py gives it its certificate.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from diloco.operator.admission import checks as spec_checks
from diloco.operator.admission.certificates import prepare
from diloco.operator.context import Config, Context
from diloco.operator.kueue import integration as kueue
from diloco.operator.reconcile import passes

INVALID = 422  # the API server's own code for an object that fails validation


def problems(body: Mapping[str, Any], config: Config) -> list[str]:
    """What the operator's next reconcile would fail `body` for, each naming its field path."""
    job, found = passes.load(dict(body))
    if job is None:
        return found
    queued = kueue.queue(config.kueue, job.metadata.labels) is not None
    return spec_checks.install_problems(job, gateway_api=config.gateway_api, queued=queued)


def refusal(operation: str | None, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None,
            config: Config) -> str | None:
    """The message `kubectl apply` prints, or None to admit: a created job with any problem, an
    update that adds one (all the new object's problems are named)."""
    if new is None or (new.get("metadata") or {}).get("deletionTimestamp"):
        return None
    found = problems(new, config)
    if not found:
        return None
    if operation == "UPDATE" and old is not None and set(found) <= set(problems(old, config)):
        return None
    return "; ".join(found)


async def validate(*, memo: Any, operation: str | None = None, old: Any = None, new: Any = None,
                   **_: Any) -> None:
    """Pure and quick, so it runs on kopf's loop, never queued behind reconciles in its threads."""
    ctx: Context = memo["ctx"]
    message = refusal(operation, old, new, ctx.config)
    if message is not None:
        raise kopf.AdmissionError(message, code=INVALID)


def serve(settings: kopf.OperatorSettings, memo: Any, **_: Any) -> None:
    """Startup: the certificate ready, then kopf's webhook server on it (it starts once startup ends)."""
    ctx: Context = memo["ctx"]
    options = ctx.config.webhook
    if options is None:
        return
    prepare(ctx.connect(), options, datetime.datetime.now(datetime.UTC))
    settings.admission.server = kopf.WebhookServer(addr=options.addr or None, port=options.port,
                                                   certfile=str(options.certfile), pkeyfile=str(options.keyfile))


def register(registry: kopf.OperatorRegistry, resource: tuple[str, str, str], when: Callable[..., bool]) -> None:
    kopf.on.startup(registry=registry, id="webhook")(serve)
    kopf.on.validate(*resource, registry=registry, id="validate", operations=["CREATE", "UPDATE"], when=when)(validate)
