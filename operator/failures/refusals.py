"""Pure: children and pods the cluster refuses, and how the job shows them.

A ResourceQuota, an admission webhook (Gatekeeper, Kyverno), an admission plugin (LimitRanger,
PodSecurity), the operator's RBAC or the server's own validation can refuse a child the job
needs; the same checks refuse the *pods* that the StatefulSet and ReplicaSet controllers create
for the job, and the kubelet refuses to start a container whose Secret or ConfigMap is missing
(operator/failures/pod_refusals.py reads those). None of these pass on a retry of the same write, and none is an
operator error: the refusal is the cluster's answer, so it is shown on the job, where its owner
looks, and the operator goes on with the other children (children.sync) and retries on its next
pass, since a quota raised or a policy changed makes the same write pass. The job gets condition
ChildrenRefused (the first refusal's reason, what refused it by name, the API server's message
and the fix), a Warning Event whenever the refusals change, and
`diloco_operator_child_writes_refused_total` (by kind, `Pod` for pods, and reason) counts each
refused write, and each pass that sees a pod refused; the condition turns False once every child
is written and no pod is refused. Other errors (the server unreachable, 5xx, conflicts) still
leave the pass for kopf to retry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from diloco.operator.kube import ApiError
from diloco.operator.status import conditions as c

# HTTP statuses that are the cluster's answer to the write itself: 400 BadRequest, 403
# Forbidden (RBAC, quota, admission plugins and webhooks), 422 Invalid.
REFUSED = frozenset({400, 403, 422})
QUOTA, WEBHOOK, FORBIDDEN, INVALID, BAD = "QuotaExceeded", "AdmissionDenied", "Forbidden", "Invalid", "BadRequest"
CONFIG = "ContainerConfigError"  # the kubelet cannot start a container: a Secret or ConfigMap it names
REASONS = (QUOTA, WEBHOOK, FORBIDDEN, INVALID, BAD, CONFIG)  # the metric's reason label: bounded
FIXES = {
    QUOTA: ("raise the namespace's ResourceQuota (kubectl describe resourcequota) or lower the job's replicas or "
            "resources"),
    WEBHOOK: ("an admission webhook's policy refused it: change the job (its resources, spec.learnerGroups[].pod "
              "or .template, spec.syncer.pod or .template) or ask the policy's owner for an exception"),
    FORBIDDEN: ("the operator's RBAC (the chart's ClusterRole) or an admission plugin (LimitRanger, PodSecurity) "
                "refused it: the message says which"),
    INVALID: "the API server found the rendered object invalid: check the job fields the message names",
    BAD: "the API server could not read the rendered object: check the job fields the message names",
    CONFIG: ("the kubelet cannot build the container's environment or user from what the pod template names "
             "(spec.learnerGroups[].template, spec.syncer.template): the message says what is missing"),
}
TEMPLATES = "spec.learnerGroups[].template and spec.syncer.template"
# Who tries again, appended to a fix: the operator writes its children on every pass; the
# controllers retry a pod on a back-off that grows to about 16 minutes; the kubelet likewise.
RETRY = {"write": "the operator retries on every pass",
         "create": "the controller retries on its own, on a back-off that grows to about 16 minutes",
         "start": "the kubelet retries on its own"}
CLEAR = "ChildrenWritten"  # the condition's reason once nothing is refused

_QUOTA = re.compile(r"(exceeded quota|status unknown for quota|failed quota): ([\w.-]+)")
_WEBHOOK = re.compile(r'admission webhook "([^"]+)" denied the request')
_UNREACHABLE = re.compile(r'failed calling webhook "([^"]+)"')
_GATEKEEPER = re.compile(r"denied the request: \[([\w.-]+)\]")
_KYVERNO = re.compile(r"(?:blocked due to the following policies|for resource violation):?\s*\n\s*([\w.-]+):")
_POD_SECURITY = re.compile(r'violates PodSecurity "([^"]+)"')
_LIMIT_RANGE = re.compile(r"(?:maximum|minimum) \S+ usage per (?:Container|Pod)|limit to request ratio per")
_MISSING = re.compile(r'(secret|configmap)s? "([^"]+)" not found', re.IGNORECASE)
_MISSING_KEY = re.compile(r"couldn't find key (\S+) in (Secret|ConfigMap) (?:[\w.-]+/)?([\w.-]+)")


@dataclass(frozen=True)
class Refusal:
    """One child write, pod creation or container start the cluster refused."""

    kind: str  # the child's kind, or Pod
    name: str  # the child's or pod's name; "" for a pod a ReplicaSet names itself
    verb: str  # create, update or delete (a child); create (a pod), start (a container)
    reason: str  # one of REASONS
    message: str  # the API server's (or the kubelet's)
    by: str = ""  # what refused it, by name: ResourceQuota q, admission webhook "w", PodSecurity "restricted"
    owner: str = ""  # a pod's workload: "StatefulSet demo-us", "Deployment demo-syncer"
    hint: str = ""  # the fix where it depends on what refused it; else FIXES[reason]

    @property
    def fix(self) -> str:
        return self.hint or FIXES[self.reason]

    def head(self) -> str:
        """What was refused and by what, without the message: the same while the refusal is."""
        who = " ".join(x for x in (self.kind, self.name) if x) + (f" of {self.owner}" if self.owner else "")
        return f"{who}: {self.verb} refused ({self.reason}{', ' + self.by if self.by else ''})"

    def describe(self) -> str:
        return f"{self.head()}: {self.message}; fix: {self.fix}"


def refused(exc: ApiError) -> bool:
    """Whether `exc` is the cluster refusing the write (shown on the job), not a failure to reach it."""
    return exc.status in REFUSED


def classify(message: str, verb: str = "write") -> tuple[str, str, str]:
    """(reason, what refused it by name, the fix) from an admission refusal's message: a refused
    write's (`verb` write) or a refused pod's (`verb` create: a controller's FailedCreate)."""
    retry = RETRY.get(verb, RETRY["write"])
    if (m := _QUOTA.search(message)) is not None:
        quota = m.group(2)
        if m.group(1) == "failed quota":  # it tracks a resource the pod does not ask for
            return QUOTA, f"ResourceQuota {quota}", (
                f"ResourceQuota {quota} tracks a resource the pod does not request: set it in "
                f"spec.learnerGroups[].resources and spec.syncer.resources (or give the namespace a LimitRange "
                f"default); {retry}")
        return QUOTA, f"ResourceQuota {quota}", (
            f"raise the namespace's ResourceQuota {quota} (kubectl describe resourcequota {quota}) or lower the "
            f"job's replicas or resources; {retry}")
    if (m := _WEBHOOK.search(message)) is not None:
        policy = _GATEKEEPER.search(message)
        kyverno = _KYVERNO.search(message)
        rule = f", Gatekeeper constraint {policy.group(1)}" if policy else \
            f", Kyverno policy {kyverno.group(1)}" if kyverno else ""
        by = f'admission webhook "{m.group(1)}"{rule}'
        return WEBHOOK, by, (f"the policy of {by} refused it: meet it in the job (its resources, {TEMPLATES}) "
                             f"or ask the policy's owner for an exception; {retry}")
    if (m := _UNREACHABLE.search(message)) is not None:
        by = f'admission webhook "{m.group(1)}"'
        return WEBHOOK, by, (f"{by} could not be called and fails closed: its owner must bring it back "
                             f"(kubectl get validatingwebhookconfigurations,mutatingwebhookconfigurations); {retry}")
    if (m := _POD_SECURITY.search(message)) is not None:
        by = f'PodSecurity "{m.group(1)}"'
        return FORBIDDEN, by, (f"the namespace's PodSecurity enforce level ({m.group(1)}) refused the pod: set the "
                               f"fields the message names (securityContext) in {TEMPLATES}, or have the namespace's "
                               f"pod-security.kubernetes.io/enforce label lowered; {retry}")
    if "unable to validate against any pod security policy" in message:
        return FORBIDDEN, "PodSecurityPolicy", (
            f"no PodSecurityPolicy the pod may use admits it: meet one in {TEMPLATES} or have one granted to the "
            f"namespace's ServiceAccount; {retry}")
    if _LIMIT_RANGE.search(message):
        return FORBIDDEN, "LimitRange", (
            f"a LimitRange in the namespace (kubectl describe limitrange) bounds the pod's resources: fit "
            f"spec.learnerGroups[].resources and spec.syncer.resources within it; {retry}")
    if "resourcequota" in message.lower():
        return QUOTA, "", f"{FIXES[QUOTA]}; {retry}"
    if verb != "write" and " is invalid: " in message:
        return INVALID, "", f"the API server found the pod invalid: check the fields of {TEMPLATES} it names"
    if verb != "write":  # the controllers' RBAC is the cluster's: an admission plugin or policy
        return FORBIDDEN, "", f"an admission plugin or policy refused the pod: the message says which; {retry}"
    return FORBIDDEN, "", FIXES[FORBIDDEN]


def config_error(message: str) -> tuple[str, str]:
    """(what is missing, by name, and the fix) for a container the kubelet will not start
    (CreateContainerConfigError): a Secret or ConfigMap, one of their keys, or a user."""
    retry = RETRY["start"]
    if (m := _MISSING.search(message)) is not None:
        kind = "Secret" if m.group(1).lower() == "secret" else "ConfigMap"
        return f'{kind} "{m.group(2)}"', (f"create {kind} {m.group(2)} in the job's namespace, or correct the "
                                          f"reference to it (env valueFrom, envFrom) in {TEMPLATES}; {retry}")
    if (m := _MISSING_KEY.search(message)) is not None:
        return f'{m.group(2)} "{m.group(3)}"', (f"add key {m.group(1)} to {m.group(2)} {m.group(3)}, or correct "
                                               f"the reference to it in {TEMPLATES}; {retry}")
    if "runAsNonRoot" in message or "non-numeric user" in message:
        return "securityContext.runAsNonRoot", (f"the image runs as root (or a named user) where runAsNonRoot is "
                                                f"set: set securityContext.runAsUser in {TEMPLATES}")
    return "", f"{FIXES[CONFIG]}; {retry}"


def reason(exc: ApiError) -> str:
    """Which kind of refusal, from the status and the API server's message."""
    if exc.status == 422:
        return INVALID
    if exc.status == 400:
        return BAD
    return classify(exc.detail)[0]


def of(obj: dict[str, Any], verb: str, exc: ApiError) -> Refusal:
    why = reason(exc)
    by, hint = classify(exc.detail)[1:] if why not in (INVALID, BAD) else ("", "")
    return Refusal(obj["kind"], obj["metadata"]["name"], verb, why, exc.detail, by=by, hint=hint)


def condition(conds: list[c.Condition], found: list[Refusal], stamp: str, generation: int) -> list[c.Condition]:
    """ChildrenRefused: True while a child write or a pod is refused; absent on jobs that never had one."""
    if found:
        first = found[0]
        more = f" (and {len(found) - 1} more: {'; '.join(r.head() for r in found[1:])})" if len(found) > 1 else ""
        return c.set_condition(conds, c.CHILDREN_REFUSED, True, reason=first.reason,
                               message=first.describe() + more, now=stamp, generation=generation)
    if c.find(conds, c.CHILDREN_REFUSED) is None:
        return conds
    return c.set_condition(conds, c.CHILDREN_REFUSED, False, reason=CLEAR,
                           message="every child was written and no pod is refused", now=stamp, generation=generation)


def news(old: list[c.Condition], new: list[c.Condition], found: list[Refusal]) -> list[Refusal]:
    """The refusals to post as Events: all of them when the condition just became True, else
    those the condition did not name before (another child or pod, verb, reason or refuser);
    none on a repeat, though the message (a quota's usage, a generated pod name) moves."""
    before, after = c.find(old, c.CHILDREN_REFUSED), c.find(new, c.CHILDREN_REFUSED)
    if not found or after is None:
        return []
    if before is None or before.get("status") != "True":
        return found
    said = str(before.get("message") or "")
    return [r for r in found if not _named(said, r.head())]


def _named(message: str, head: str) -> bool:
    """Whether the condition's message names this refusal: first, or in its list of the others."""
    return message.startswith(head) or f"more: {head}" in message or f"; {head}" in message
