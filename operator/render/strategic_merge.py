"""Pure: a user's pod template (`learnerGroups[].template`, `syncer.template`) merged onto the pod
template the operator rendered, the way `kubectl patch --type strategic` merges a PodTemplateSpec
(the patch strategies of the Kubernetes API), once overlay.template_problems found nothing the
operator owns in it:

- maps merge recursively, key by key at every depth (labels, annotations, nodeSelector, the pod's
  and a container's securityContext, dnsConfig, a container's lifecycle ...): adding
  `capabilities.add: [IPC_LOCK]` keeps the operator's `capabilities.drop: [ALL]`; a key set to
  null is removed (the patch's delete); lists inside them (`capabilities.drop`, `sysctls`,
  `dnsConfig.options`) are replaced, as the API gives them no merge key;
- lists of named things merge by name: containers (the operator's container, `learner` or
  `syncer`, by its name; any other name is a sidecar, appended), initContainers; a container's
  volumeMounts by mountPath;
- a volume or resource claim of the same name, and an env var of the same name, is *replaced*
  as a whole: they hold one source each (a volume's emptyDir or persistentVolumeClaim, an env
  var's value or valueFrom), which a key-by-key merge would double and the API server refuse
  (volumes are `retainKeys` in the API); a template volume named like the overlay's is refused
  before this (overlay.template_problems), one named like the operator's too;
- a probe the template gives the operator's container merges onto the operator's probe, except
  that a handler (exec, httpGet, tcpSocket, grpc) in the template replaces the operator's (a
  probe has one handler; two are refused by the API server);
- tolerations, topologySpreadConstraints, readinessGates, hostAliases and envFrom are appended;
- affinity merges as a map, except that the pod (anti-)affinity terms the operator sets (a
  group's learners spread over nodes; a multi-host learner's hosts in one TPU slice) are kept
  and the template's appended;
- every other field is set (runtimeClassName, schedulerName, hostNetwork, dnsPolicy,
  terminationGracePeriodSeconds, ...).
"""

from __future__ import annotations

import copy
from typing import Any

from diloco.spec import PodTemplate

APPENDED = ("tolerations", "topologySpreadConstraints", "readinessGates", "hostAliases")
REPLACED_BY_NAME = ("volumes", "resourceClaims")  # one source each: the same name replaces the item
MERGED_BY_NAME = ("initContainers", "imagePullSecrets")
MERGED_MAPS = ("nodeSelector", "securityContext", "overhead", "dnsConfig", "os", "resources")
CONTAINER_MAPS = ("securityContext", "lifecycle")
PROBES = ("livenessProbe", "startupProbe", "readinessProbe")
HANDLERS = ("exec", "httpGet", "tcpSocket", "grpc")


def deep(ours: Any, theirs: Any) -> Any:
    """`theirs` merged onto `ours` as a strategic merge merges two maps: recursively, null
    deleting a key; anything that is not a map on both sides (a list, a scalar) is replaced."""
    if not isinstance(theirs, dict):
        return copy.deepcopy(theirs)
    out = copy.deepcopy(ours) if isinstance(ours, dict) else {}
    for key, value in theirs.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = deep(out[key], value) if key in out else copy.deepcopy(value)
    return out


def by_key(key: str, ours: list[Any], theirs: list[Any], *, whole: bool = False) -> list[Any]:
    """A list merged by `key`: ours in order, each updated by the template's item of the same key
    (merged onto it, or replacing it when `whole`), then the template's new items."""
    mine = {x.get(key): i for i, x in enumerate(ours) if isinstance(x, dict)}
    out = [copy.deepcopy(x) for x in ours]
    for item in theirs:
        k = item.get(key) if isinstance(item, dict) else None
        if k is not None and k in mine:
            out[mine[k]] = copy.deepcopy(item) if whole else deep(out[mine[k]], item)
        else:
            out.append(copy.deepcopy(item))
    return out


def _appended(ours: list[Any], theirs: list[Any]) -> list[Any]:
    return [*copy.deepcopy(ours), *(copy.deepcopy(x) for x in theirs if x not in ours)]


def _affinity(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """The template's affinity over ours: nodeAffinity merged, pod (anti-)affinity terms appended."""
    out = copy.deepcopy(ours)
    for kind, value in theirs.items():
        if kind in ("podAffinity", "podAntiAffinity") and isinstance(value, dict):
            mine = dict(out.get(kind) or {})
            for rule, terms in value.items():
                mine[rule] = _appended(mine.get(rule) or [], terms or []) if isinstance(terms, list) else terms
            out[kind] = mine
        else:
            out[kind] = deep(out.get(kind), value)
    return out


def _probe(ours: Any, theirs: Any) -> Any:
    """A probe merged onto ours; a handler of the template's replaces ours (a probe has one)."""
    if isinstance(ours, dict) and isinstance(theirs, dict) and any(h in theirs for h in HANDLERS):
        ours = {k: v for k, v in ours.items() if k not in HANDLERS}
    return deep(ours, theirs)


def container(ours: dict[str, Any], theirs: dict[str, Any]) -> dict[str, Any]:
    """The operator's container with the template's container of the same name merged onto it."""
    out = copy.deepcopy(ours)
    for key, value in theirs.items():
        if key == "env":
            out["env"] = by_key("name", out.get("env") or [], value, whole=True)
        elif key == "volumeMounts":
            out["volumeMounts"] = by_key("mountPath", out.get("volumeMounts") or [], value)
        elif key == "envFrom":
            out["envFrom"] = _appended(out.get("envFrom") or [], value)
        elif key in CONTAINER_MAPS:
            out[key] = deep(out.get(key), value)
        elif key in PROBES:
            out[key] = _probe(out.get(key), value)
        elif key != "name":
            out[key] = copy.deepcopy(value)
    return out


def merge_template(rendered: dict[str, Any], template: PodTemplate | None) -> dict[str, Any]:
    """`rendered` (a pod template the operator made, its overlay merged in) with `template`
    merged onto it (the module docstring says how); checked first by overlay.template_problems."""
    if template is None or template == PodTemplate():
        return rendered
    out = copy.deepcopy(rendered)
    meta, spec = out.setdefault("metadata", {}), out["spec"]
    for part in ("labels", "annotations"):
        extra = getattr(template.metadata, part)
        if extra:
            meta[part] = {**(meta.get(part) or {}), **extra}
    for key, value in template.spec.items():
        if key == "containers":
            ours = {c["name"]: i for i, c in enumerate(spec["containers"])}
            for c in value:
                if c.get("name") in ours:
                    i = ours[c["name"]]
                    spec["containers"][i] = container(spec["containers"][i], c)
                else:
                    spec["containers"].append(copy.deepcopy(c))
        elif key in REPLACED_BY_NAME:
            spec[key] = by_key("name", spec.get(key) or [], value, whole=True)
        elif key in MERGED_BY_NAME:
            spec[key] = by_key("name", spec.get(key) or [], value)
        elif key in APPENDED:
            spec[key] = _appended(spec.get(key) or [], value)
        elif key == "affinity":
            spec[key] = _affinity(spec.get(key) or {}, value)
        elif key in MERGED_MAPS:
            spec[key] = deep(spec.get(key), value)
        else:
            spec[key] = copy.deepcopy(value)
    return out
