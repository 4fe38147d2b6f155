"""A user's pod overlay (`learnerGroups[].pod`, `syncer.pod`) merged into the rendered pods."""

from __future__ import annotations

from typing import Any

import kubernetes_validate
import pytest

from diloco.operator import crd, render
from diloco.operator import naming as n
from diloco.spec import SpecError, parse_job

OWNER = render.Owner("demo", "research", "0f5a1f4e-0000-4000-8000-000000000000")
POD = {"labels": {"team": "pretrain", n.JOB: "not-this"}, "annotations": {"cost-center": "42"},
       "serviceAccountName": "bucket-reader", "automountServiceAccountToken": True,
       "imagePullSecrets": [{"name": "regcred"}], "priorityClassName": "training-high",
       "env": [{"name": "GOOGLE_CLOUD_PROJECT", "value": "p"}],
       "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}],
       "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}]}


def job(group_pod: dict[str, Any] | None = None, syncer_pod: dict[str, Any] | None = None) -> Any:
    group: dict[str, Any] = {"name": "us", "replicas": 2, **({"pod": group_pod} if group_pod else {})}
    syncer: dict[str, Any] = {"pod": syncer_pod} if syncer_pod else {}
    return parse_job({"apiVersion": "diloco.dev/v1alpha1", "kind": "DecoupledDiLoCoJob", "metadata": {"name": "demo"},
                      "spec": {"learnerGroups": [group], "syncer": syncer}})


def templates(j: Any) -> dict[str, dict[str, Any]]:
    objs = render.children(j, OWNER, "t" * 43, started=True, finished=False)
    return {o["kind"]: o["spec"]["template"] for o in objs if o["kind"] in ("StatefulSet", "Deployment")}


def test_the_overlay_is_merged_under_the_operators_own_fields() -> None:
    plain, merged = templates(job())["StatefulSet"], templates(job(POD))["StatefulSet"]
    meta, spec = merged["metadata"], merged["spec"]
    assert meta["labels"]["team"] == "pretrain" and meta["labels"][n.JOB] == "demo"  # the selector stays ours
    assert meta["annotations"]["cost-center"] == "42" and n.CONFIG_HASH in meta["annotations"]
    assert (spec["serviceAccountName"], spec["automountServiceAccountToken"], spec["priorityClassName"]) == (
        "bucket-reader", True, "training-high")
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["volumes"] == [*plain["spec"]["volumes"], POD["volumes"][0]]
    (c,), (c0,) = spec["containers"], plain["spec"]["containers"]
    assert c["env"] == [*c0["env"], {"name": "GOOGLE_CLOUD_PROJECT", "value": "p"}]
    assert c["volumeMounts"] == [*c0["volumeMounts"], POD["volumeMounts"][0]]
    assert (c["args"], c["securityContext"], c["readinessProbe"]) == (c0["args"], c0["securityContext"],
                                                                      c0["readinessProbe"])
    assert templates(job(POD))["Deployment"] == templates(job())["Deployment"]  # the group's only
    assert templates(job(syncer_pod={"priorityClassName": "syncer"}))["Deployment"]["spec"]["priorityClassName"] == \
        "syncer"


def test_the_rendered_pods_are_valid_kubernetes() -> None:
    for template in templates(job(POD, {"serviceAccountName": "s"})).values():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **template["metadata"]},
               "spec": template["spec"]}
        kubernetes_validate.validate(pod, "1.30", strict=True)


@pytest.mark.parametrize("pod, problem", [
    ({"volumes": [{"name": "token", "emptyDir": {}}]}, "spec.learnerGroups[0].pod.volumes[0].name: 'token' is the "
                                                       "operator's"),
    ({"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "/etc/diloco/x"}]},
     "spec.learnerGroups[0].pod.volumeMounts[0].mountPath: '/etc/diloco/x' is (inside) the operator's mount"),
    ({"volumeMounts": [{"name": "nope", "mountPath": "/data"}]},
     "spec.learnerGroups[0].pod.volumeMounts[0].name: 'nope' names no volume"),
])
def test_clashes_with_what_the_operator_mounts_are_refused_with_the_field(pod: dict[str, Any], problem: str) -> None:
    (found,) = render.name_problems(job(pod))
    assert found.startswith(problem)


def test_variables_the_operator_sets_cannot_be_overridden() -> None:
    with pytest.raises(SpecError) as err:
        job({"env": [{"name": "DILOCO_TOKEN", "value": "x"}]})
    assert str(err.value) == "spec.learnerGroups[0].pod.env[0].name: DILOCO_TOKEN is set by the operator; choose another name"


def test_the_crd_keeps_volumes_as_given() -> None:
    """Structural schemas prune unknown fields: a volume's content must survive as written."""
    pod = crd.spec_schema()["properties"]["learnerGroups"]["items"]["properties"]["pod"]["properties"]
    assert pod["volumes"]["items"] == {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    assert pod["serviceAccountName"]["type"] == "string"
