"""Merge a user's pod overlay (`learnerGroups[].pod`, `syncer.pod`: diloco/spec_pod.py) into a
rendered pod template. Pure: the template in, a new one out.

Merging, not replacing: labels and annotations are added under ours (the selector labels are
the operator's), env, volumes, mounts and pull secrets are appended, the service account and
priority class are set. A clash with what the operator mounts is refused before anything is
rendered (`job_problems`, reported like a spec error with the field path).
"""

from __future__ import annotations

import copy
from typing import Any

from diloco.operator import naming as n
from diloco.spec import DecoupledDiLoCoJob
from diloco.spec_pod import PodOverlay


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


# The volumes and mount paths every job pod gets from the operator (parts.py, render.py).
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
    """Every overlay of the job, with its field path."""
    overlays = {f"spec.learnerGroups[{i}].pod": g.pod for i, g in enumerate(job.spec.learner_groups)}
    overlays["spec.syncer.pod"] = job.spec.syncer.pod
    return [p for where, overlay in overlays.items() for p in problems(where, overlay)]
