"""Merge a user's pod overlay (`learnerGroups[].pod`, `syncer.pod`) and then pod template
(`learnerGroups[].template`, `syncer.template`: diloco/spec/pod.py) into a rendered pod
template. Pure: the template in, a new one out.

The overlay merges, not replaces: labels and annotations are added under ours (the selector
labels are the operator's), env, volumes, mounts and pull secrets are appended, the service
account and priority class are set.

The template is merged as `kubectl patch --type strategic` merges a PodTemplateSpec, with the
operator's own fields protected (operator/render/strategic_merge.py says how, field by field). What the operator
owns is refused, each with its field path and why (`template_problems`, run at admission and by
`diloco validate`): the operator's container's image, command, args, ports, readiness probe and
resources (the spec's own fields set those), the learner's terminationMessagePath and policy
(its finished marker: operator/status/steps.py), the env it sets, its volumes and mount paths, a
volume named like one of the overlay's (set it in one place), the labels and annotations it
selects and tracks pods by, Kueue's queue and priority labels (they belong on the job), the
fields a StatefulSet or Deployment fixes (restartPolicy, hostname, subdomain, nodeName), the
pod's schedulingGates (the operator and Kueue gate pods), and a node label the group's
nodeSelector sets otherwise. A learner may have a liveness or startup probe (a kill restarts it;
only its termination message ends it: operator/status/steps.py), but not one on /readyz (ready means
joined to the syncer, which a healthy learner is not while the syncer restarts: every learner
would be killed), and not a liveness probe with neither a startupProbe nor initialDelaySeconds
(the learner opens its metrics port only after compiling its steps: it would be killed in its
compile, over and over). A clash with what the operator mounts is refused before anything is
rendered (`job_problems`, reported like a spec error with the field path).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from diloco.operator.render import naming as n
from diloco.operator.render.strategic_merge import merge_template
from diloco.spec import RESERVED_NAMES, RESERVED_PREFIXES, DecoupledDiLoCoJob, PodOverlay, PodTemplate


def _dump(items: list[Any]) -> list[dict[str, Any]]:
    return [x.model_dump(mode="json", by_alias=True) if hasattr(x, "model_dump") else dict(x) for x in items]


def apply(template: dict[str, Any], overlay: PodOverlay | None) -> dict[str, Any]:
    """The pod template with `overlay` merged in (its only container gets the env and mounts)."""
    if overlay is None or overlay == PodOverlay():
        return template
    out = copy.deepcopy(template)
    meta, spec = out.setdefault("metadata", {}), out["spec"]
    meta["labels"] = {**overlay.labels, **(meta.get("labels") or {})}
    meta["annotations"] = {**overlay.annotations, **(meta.get("annotations") or {})}
    if overlay.service_account_name:
        spec["serviceAccountName"] = overlay.service_account_name
    spec["automountServiceAccountToken"] = overlay.automount_service_account_token
    if overlay.priority_class_name:
        spec["priorityClassName"] = overlay.priority_class_name
    if overlay.image_pull_secrets:
        spec["imagePullSecrets"] = [*spec.get("imagePullSecrets", []), *_dump(overlay.image_pull_secrets)]
    spec["volumes"] = [*spec.get("volumes", []), *copy.deepcopy(overlay.volumes)]
    (container,) = spec["containers"]
    container["env"] = [*container.get("env", []), *_dump(overlay.env)]
    container["volumeMounts"] = [*container.get("volumeMounts", []), *copy.deepcopy(overlay.volume_mounts)]
    return out


# The volumes and mount paths every job pod gets from the operator (operator/render/parts.py, operator/render/job.py).
OUR_VOLUMES = frozenset({"config", "tmp", "token", "tls", n.CHECKPOINT_VOLUME})
OUR_PATHS = frozenset({n.CONFIG_DIR, "/tmp", n.TOKEN_DIR, n.TLS_DIR, n.CHECKPOINT_DIR})


def problems(where: str, overlay: PodOverlay | None) -> list[str]:
    """Clashes of `overlay` (at field path `where`) with what the operator mounts itself."""
    if overlay is None:
        return []
    out = []
    names = {v.get("name") for v in overlay.volumes}
    for i, volume in enumerate(overlay.volumes):
        if not isinstance(volume.get("name"), str) or not volume["name"]:
            out.append(f"{where}.volumes[{i}].name: required")
        elif volume["name"] in OUR_VOLUMES:
            out.append(f"{where}.volumes[{i}].name: {volume['name']!r} is the operator's; choose another name")
    for i, mount in enumerate(overlay.volume_mounts):
        if mount.get("name") not in names:
            out.append(f"{where}.volumeMounts[{i}].name: {mount.get('name')!r} names no volume of {where}.volumes")
        path = mount.get("mountPath")
        if not isinstance(path, str) or not path.startswith("/"):
            out.append(f"{where}.volumeMounts[{i}].mountPath: an absolute path is required")
        elif any(path == ours or path.startswith(ours + "/") for ours in OUR_PATHS):
            out.append(f"{where}.volumeMounts[{i}].mountPath: {path!r} is (inside) the operator's mount; "
                       "choose another path")
    return out


def job_problems(job: DecoupledDiLoCoJob) -> list[str]:
    """Every overlay and template of the job, with its field path."""
    overlays = {f"spec.learnerGroups[{i}].pod": g.pod for i, g in enumerate(job.spec.learner_groups)}
    overlays["spec.syncer.pod"] = job.spec.syncer.pod
    out = [p for where, overlay in overlays.items() for p in problems(where, overlay)]
    for i, g in enumerate(job.spec.learner_groups):
        out += template_problems(f"spec.learnerGroups[{i}].template", g.template, container=n.LEARNER, pod=g.pod,
                                 owner_path=f"spec.learnerGroups[{i}]", node_selector=dict(g.node_selector))
    out += template_problems("spec.syncer.template", job.spec.syncer.template, container=n.SYNCER,
                             pod=job.spec.syncer.pod, owner_path="spec.syncer", node_selector={})
    return out


# -- pod templates ---------------------------------------------------------------------------

# PodSpec fields (Kubernetes 1.34) by the JSON type each holds: a template's spec is checked
# against these before it is merged, so a typo is refused with its path, not dropped by the
# API server. "named": a list of objects each with a name.
OBJECT, LIST, NAMED, STRING, BOOL, INT, MAP = "object", "list", "named", "string", "boolean", "integer", "map"
WANTED = {OBJECT: "an object", LIST: "a list", NAMED: "a list of objects", STRING: "a string", BOOL: "a boolean",
          INT: "an integer", MAP: "a map of strings"}
POD_FIELDS: dict[str, str] = {
    "containers": NAMED, "initContainers": NAMED, "ephemeralContainers": NAMED, "volumes": NAMED,
    "imagePullSecrets": NAMED, "schedulingGates": NAMED, "resourceClaims": NAMED,
    "tolerations": LIST, "topologySpreadConstraints": LIST, "readinessGates": LIST, "hostAliases": LIST,
    "nodeSelector": MAP, "overhead": MAP,
    "affinity": OBJECT, "securityContext": OBJECT, "dnsConfig": OBJECT, "os": OBJECT, "resources": OBJECT,
    "runtimeClassName": STRING, "schedulerName": STRING, "dnsPolicy": STRING, "priorityClassName": STRING,
    "serviceAccountName": STRING, "serviceAccount": STRING, "preemptionPolicy": STRING, "nodeName": STRING,
    "hostname": STRING, "subdomain": STRING, "restartPolicy": STRING, "hostnameOverride": STRING,
    "hostNetwork": BOOL, "hostPID": BOOL, "hostIPC": BOOL, "shareProcessNamespace": BOOL,
    "automountServiceAccountToken": BOOL, "enableServiceLinks": BOOL, "setHostnameAsFQDN": BOOL, "hostUsers": BOOL,
    "terminationGracePeriodSeconds": INT, "activeDeadlineSeconds": INT, "priority": INT,
}
CONTAINER_FIELDS: dict[str, str] = {
    "name": STRING, "image": STRING, "imagePullPolicy": STRING, "workingDir": STRING,
    "terminationMessagePath": STRING, "terminationMessagePolicy": STRING, "restartPolicy": STRING,
    "command": LIST, "args": LIST, "ports": LIST, "envFrom": LIST, "volumeDevices": LIST, "resizePolicy": LIST,
    "restartPolicyRules": LIST, "env": NAMED, "volumeMounts": LIST,
    "resources": OBJECT, "securityContext": OBJECT, "lifecycle": OBJECT, "livenessProbe": OBJECT,
    "readinessProbe": OBJECT, "startupProbe": OBJECT,
    "stdin": BOOL, "stdinOnce": BOOL, "tty": BOOL,
}
# Pod fields a template may not set, and why.
POD_OWNED = {
    "hostname": "a StatefulSet names its pods (learners and a sharded syncer are found by those names)",
    "subdomain": "a StatefulSet sets it to the group's headless Service",
    "hostnameOverride": "learners and a sharded syncer are found by their pods' names",
    "nodeName": "it bypasses the scheduler and Kueue; use nodeSelector or affinity",
    "ephemeralContainers": "they are added to running pods (kubectl debug), not to templates",
    "activeDeadlineSeconds": "it would end pods the StatefulSet restarts; use spec.runPolicy.activeDeadlineSeconds",
    "priority": "the API server sets it from priorityClassName",
    "serviceAccount": "deprecated: use serviceAccountName",
    "schedulingGates": "the operator and Kueue gate pods until they may be placed; hold a job back with "
                       "spec.suspend or a Kueue queue",
}
# Fields of the operator's own container a template may not set, and where they come from.
CONTAINER_OWNED = {
    "image": "{where}.image", "command": "the learner-syncer contract", "args": "the learner-syncer contract",
    "ports": "the learner-syncer contract (Services and probes name them)",
    "readinessProbe": "the learner-syncer contract (ready means joined to the syncer)",
    "resources": "{where}.resources (Kueue reserves what it says)",
    "restartPolicy": "only init containers take one",
}
# ... and of the learner's alone.
LEARNER_OWNED = {
    "terminationMessagePath": "the learner-syncer contract (the learner writes there that it reached "
                              "spec.training.steps)",
    "terminationMessagePolicy": "the learner-syncer contract (File: only the learner's own word ends the job)",
}
PROBED = ("livenessProbe", "startupProbe")
# The labels and annotations the operator selects, tracks and restarts pods by (and Kueue's).
OWNED_KEYS = ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
              "app.kubernetes.io/component", n.INDEX, "kueue.x-k8s.io/podset", "kueue.x-k8s.io/workload")
OWNED_PREFIX = "diloco.dev/"
# Kueue's labels that select a queue and a priority: read from the job, never from its pods.
JOB_LABELS = ("kueue.x-k8s.io/queue-name", "kueue.x-k8s.io/priority-class")


def _owned_key(key: str) -> bool:
    return key.startswith(OWNED_PREFIX) or key in OWNED_KEYS


def _type_ok(value: Any, kind: str) -> bool:
    if kind in (OBJECT, MAP):
        return isinstance(value, dict) and (kind == OBJECT or all(isinstance(v, str | int) for v in value.values()))
    if kind == LIST:
        return isinstance(value, list)
    if kind == NAMED:
        return isinstance(value, list) and all(isinstance(x, dict) for x in value)
    if kind == STRING:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    return isinstance(value, int) and not isinstance(value, bool)


def _shape_problems(where: str, obj: Mapping[str, Any], fields: Mapping[str, str], what: str) -> list[str]:
    out = []
    for key, value in obj.items():
        kind = fields.get(key)
        if kind is None:
            out.append(f"{where}.{key}: not a {what} field (Kubernetes 1.34)")
        elif not _type_ok(value, kind):
            out.append(f"{where}.{key}: must be {WANTED[kind]}")
        elif kind == NAMED:
            for i, item in enumerate(value):
                if not isinstance(item.get("name"), str) or not item["name"]:
                    out.append(f"{where}.{key}[{i}].name: required")
            names = [x.get("name") for x in value]
            for dup in sorted({x for x in names if isinstance(x, str) and names.count(x) > 1}):
                out.append(f"{where}.{key}: {dup!r} appears twice")
    return out


def _reserved_env(name: str) -> bool:
    return name.startswith(RESERVED_PREFIXES) or name in RESERVED_NAMES


def _learner_problems(path: str, c: Mapping[str, Any]) -> list[str]:
    """The learner container's own fields, and probes that would kill healthy learners."""
    out = [f"{path}.{key}: the operator's learner container's; set by {why}"
           for key, why in LEARNER_OWNED.items() if key in c]
    for probe in PROBED:
        get = (c.get(probe) or {}).get("httpGet") or {}
        if str(get.get("path", "")).split("?", 1)[0] == "/readyz":  # as trainer/metrics.py routes it
            out.append(f"{path}.{probe}.httpGet.path: /readyz is readiness (joined to the syncer): a learner "
                       "waiting out a syncer restart fails it and would be killed; probe another path of port "
                       "metrics (any other path answers once the learner runs) or drop the probe")
    live = c.get("livenessProbe")
    if isinstance(live, dict) and "startupProbe" not in c and not live.get("initialDelaySeconds"):
        out.append(f"{path}.livenessProbe: the learner opens port metrics only after compiling its steps, so it "
                   "would be killed in its compile; add a startupProbe on port metrics whose failureThreshold x "
                   "periodSeconds covers the compile, or set livenessProbe.initialDelaySeconds")
    return out


def template_problems(where: str, template: PodTemplate | None, *, container: str, pod: PodOverlay | None,
                      owner_path: str, node_selector: Mapping[str, str]) -> list[str]:
    """Why the template at `where` cannot be merged onto the pods of `owner_path` (a learner
    group or the syncer) whose own container is `container`, each with its field path; `pod`:
    the same pods' overlay, `node_selector`: the nodeSelector they already have."""
    if template is None:
        return []
    out = []
    for part in ("labels", "annotations"):
        for key in sorted(getattr(template.metadata, part)):
            if key in JOB_LABELS:
                out.append(f"{where}.metadata.{part}[{key}]: Kueue reads it from the job, not its pods; set it in "
                           "the job's metadata.labels")
            elif _owned_key(key):
                out.append(f"{where}.metadata.{part}[{key}]: the operator's (it selects and tracks pods by it); "
                           "choose another key")
    spec, at = template.spec, f"{where}.spec"
    shape = _shape_problems(at, spec, POD_FIELDS, "PodSpec")
    if shape:  # the checks below need a well-formed PodSpec
        return out + shape
    for key, why in POD_OWNED.items():
        if key in spec:
            out.append(f"{at}.{key}: the operator's: {why}")
    if spec.get("restartPolicy", "Always") != "Always":
        out.append(f"{at}.restartPolicy: StatefulSets and Deployments run pods with Always only")
    for key, value in sorted((spec.get("nodeSelector") or {}).items()):
        if key in node_selector and node_selector[key] != value:
            out.append(f"{at}.nodeSelector[{key}]: {value!r} clashes with {owner_path}.nodeSelector's "
                       f"{node_selector[key]!r}; set it in one place")
    overlaid = {v.get("name"): i for i, v in enumerate(pod.volumes if pod else [])}
    volumes = {v["name"] for v in spec.get("volumes") or []} | set(overlaid) | OUR_VOLUMES
    for i, volume in enumerate(spec.get("volumes") or []):
        if volume["name"] in OUR_VOLUMES:
            out.append(f"{at}.volumes[{i}].name: {volume['name']!r} is the operator's; choose another name")
        elif volume["name"] in overlaid:
            out.append(f"{at}.volumes[{i}].name: {volume['name']!r} is also {owner_path}.pod.volumes"
                       f"[{overlaid[volume['name']]}]; a volume has one source: set it in one place")
    for list_name in ("containers", "initContainers"):
        for i, c in enumerate(spec.get(list_name) or []):
            path = f"{at}.{list_name}[{i}]"
            shape = _shape_problems(path, c, CONTAINER_FIELDS, "Container")
            out += shape
            if shape:
                continue
            ours = list_name == "containers" and c["name"] == container
            if ours:
                for key, why in CONTAINER_OWNED.items():
                    if key in c:
                        out.append(f"{path}.{key}: the operator's {container} container's; set by "
                                   f"{why.format(where=owner_path)}")
                for j, env in enumerate(c.get("env") or []):
                    if _reserved_env(str(env["name"])):
                        out.append(f"{path}.env[{j}].name: {env['name']} is set by the operator; choose another name")
                if container == n.LEARNER:
                    out += _learner_problems(path, c)
            elif not isinstance(c.get("image"), str) or not c["image"]:
                out.append(f"{path}.image: required ({c['name']!r} is not the operator's {container} container, so "
                           "it is a container of its own)")
            for j, mount in enumerate(c.get("volumeMounts") or []):
                mount_path = mount.get("mountPath") if isinstance(mount, dict) else None
                if not isinstance(mount, dict) or mount.get("name") not in volumes:
                    name = mount.get("name") if isinstance(mount, dict) else mount
                    out.append(f"{path}.volumeMounts[{j}].name: {name!r} names no volume of the pod")
                if not isinstance(mount_path, str) or not mount_path.startswith("/"):
                    out.append(f"{path}.volumeMounts[{j}].mountPath: an absolute path is required")
                elif ours and any(mount_path == p or mount_path.startswith(p + "/") for p in OUR_PATHS):
                    out.append(f"{path}.volumeMounts[{j}].mountPath: {mount_path!r} is (inside) the operator's "
                               "mount; choose another path")
    return out


def shape(rendered: dict[str, Any], overlay: PodOverlay | None, template: PodTemplate | None) -> dict[str, Any]:
    """The rendered pod template with the overlay, then the template, merged in."""
    return merge_template(apply(rendered, overlay), template)
