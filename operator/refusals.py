"""Pure: child writes the API server refused, and how the job shows them.

A ResourceQuota, an admission webhook (Gatekeeper, Kyverno), an admission plugin (LimitRanger,
PodSecurity), the operator's RBAC or the server's own validation can refuse a child the job
needs. None of these pass on a retry of the same write, and none is an operator error: the
refusal is the cluster's answer, so it is shown on the job, where its owner looks, and the
operator goes on with the other children (children.sync) and retries on its next pass, since
a quota raised or a policy changed makes the same write pass. The job gets condition
ChildrenRefused (the first refusal's reason and the API server's message, with the fix), a
Warning Event whenever the refusals change, and `diloco_operator_child_writes_refused_total`
(by child kind and reason) counts each refused write; the condition turns False once every
child is written. Other errors (the server unreachable, 5xx, conflicts) still leave the pass
for kopf to retry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from diloco.operator import conditions as c
from diloco.operator.kube import ApiError

# HTTP statuses that are the cluster's answer to the write itself: 400 BadRequest, 403
# Forbidden (RBAC, quota, admission plugins and webhooks), 422 Invalid.
REFUSED = frozenset({400, 403, 422})
QUOTA, WEBHOOK, FORBIDDEN, INVALID, BAD = "QuotaExceeded", "AdmissionDenied", "Forbidden", "Invalid", "BadRequest"
FIXES = {
    QUOTA: ("raise the namespace's ResourceQuota (kubectl describe resourcequota) or lower the job's replicas or "
            "resources; the operator retries on every pass"),
    WEBHOOK: ("an admission webhook's policy refused it: change the job (its resources, spec.learnerGroups[].pod "
              "or .template, spec.syncer.pod or .template) or ask the policy's owner for an exception"),
    FORBIDDEN: ("the operator's RBAC (the chart's ClusterRole) or an admission plugin (LimitRanger, PodSecurity) "
                "refused it: the message says which"),
    INVALID: "the API server found the rendered object invalid: check the job fields the message names",
    BAD: "the API server could not read the rendered object: check the job fields the message names",
}
CLEAR = "ChildrenWritten"  # the condition's reason once nothing is refused


@dataclass(frozen=True)
class Refusal:
    """One child write the API server refused."""

    kind: str
    name: str
    verb: str  # create, update or delete
    reason: str  # QUOTA, WEBHOOK, FORBIDDEN, INVALID or BAD
    message: str  # the API server's

    @property
    def fix(self) -> str:
        return FIXES[self.reason]

    def describe(self) -> str:
        return f"{self.kind} {self.name}: {self.verb} refused ({self.reason}): {self.message}; fix: {self.fix}"


def refused(exc: ApiError) -> bool:
    """Whether `exc` is the cluster refusing the write (shown on the job), not a failure to reach it."""
    return exc.status in REFUSED


def reason(exc: ApiError) -> str:
    """Which kind of refusal, from the status and the API server's message."""
    text = exc.detail.lower()
    if exc.status == 422:
        return INVALID
    if exc.status == 400:
        return BAD
    if "exceeded quota" in text or "status unknown for quota" in text or "resourcequota" in text:
        return QUOTA
    if "admission webhook" in text:
        return WEBHOOK
    return FORBIDDEN


def of(obj: dict[str, Any], verb: str, exc: ApiError) -> Refusal:
    return Refusal(obj["kind"], obj["metadata"]["name"], verb, reason(exc), exc.detail)


def condition(conds: list[c.Condition], found: list[Refusal], stamp: str, generation: int) -> list[c.Condition]:
    """ChildrenRefused: True while a child write is refused; absent on jobs that never had one."""
    if found:
        first = found[0]
        more = f" (and {len(found) - 1} more: {', '.join(f'{r.kind} {r.name}' for r in found[1:])})" \
            if len(found) > 1 else ""
        return c.set_condition(conds, c.CHILDREN_REFUSED, True, reason=first.reason,
                               message=first.describe() + more, now=stamp, generation=generation)
    if c.find(conds, c.CHILDREN_REFUSED) is None:
        return conds
    return c.set_condition(conds, c.CHILDREN_REFUSED, False, reason=CLEAR, message="every child was written",
                           now=stamp, generation=generation)


def news(old: list[c.Condition], new: list[c.Condition], found: list[Refusal]) -> list[Refusal]:
    """The refusals to post as Events: all of them when the condition just became True or now
    says something else (another child, another reason, another message); none on a repeat."""
    before, after = c.find(old, c.CHILDREN_REFUSED), c.find(new, c.CHILDREN_REFUSED)
    if not found or after is None:
        return []
    if before is not None and before.get("status") == "True" and before.get("message") == after.get("message"):
        return []
    return found
