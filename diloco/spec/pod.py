"""What a user adds to the pods the operator renders, besides their resources and tolerations:
`learnerGroups[].pod` and `syncer.pod` (a short list of common fields), and
`learnerGroups[].template` and `syncer.template` (a whole pod template).

`pod` is an overlay of the fields users need in the first week (a cloud identity for the data
bucket, a private registry, a priority, extra environment and volumes, labels for cost
allocation). `template` is the general form, in the spirit of JobSet's and KubeRay's pod
templates: a PodTemplateSpec (metadata and spec) strategically merged onto what the operator
renders, after `pod` (operator/render/overlay.py says how each field merges): sidecars and init
containers, affinity and topology spread, a runtime class or scheduler, host networking, more
volumes, env and mounts. What the learner-syncer contract needs stays the operator's: its
container's command line, image, ports, readiness probe and resources, the config and token
mounts, the labels it selects pods by; a template that sets one is refused with the field path
(operator/render/overlay.py `template_problems`, run at admission and by `diloco validate`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, WithJsonSchema, field_validator

from diloco.spec.base import DNS_SUBDOMAIN, Model

# The variables the operator sets itself (learner index, multi-host and TPU settings, HOME).
RESERVED_PREFIXES, RESERVED_NAMES = ("DILOCO_", "TPU_WORKER_"), ("POD_NAME", "HOME")
# A Kubernetes Volume or VolumeMount, validated by the API server when the pod is created.
KubeObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})]


class EnvVar(Model):
    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=253)
    value: str = ""

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, name: str) -> str:
        if name.startswith(RESERVED_PREFIXES) or name in RESERVED_NAMES:
            raise ValueError(f"{name} is set by the operator; choose another name")
        return name


class LocalObjectReference(Model):
    name: str = Field(pattern=DNS_SUBDOMAIN, max_length=253)


class PodOverlay(Model):
    labels: dict[str, str] = Field(default_factory=dict)  # ours (job, component, group) win
    annotations: dict[str, str] = Field(default_factory=dict)
    # e.g. a Workload Identity / IRSA account that may read the data bucket; unset: the default.
    service_account_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)
    # Off unless asked: learners and syncer never call the Kubernetes API; a cloud identity
    # (GKE Workload Identity, EKS IRSA) needs the projected token, so it can be turned on.
    automount_service_account_token: bool = False
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list)
    priority_class_name: str | None = Field(None, pattern=DNS_SUBDOMAIN, max_length=253)
    env: list[EnvVar] = Field(default_factory=list)  # appended to the container's own
    volumes: list[KubeObject] = Field(default_factory=list)  # names must not clash with ours
    volume_mounts: list[KubeObject] = Field(default_factory=list)  # into the learner or syncer container


class TemplateMeta(Model):
    labels: dict[str, str] = Field(default_factory=dict)  # added; the operator's keys are refused
    annotations: dict[str, str] = Field(default_factory=dict)


class PodTemplate(Model):
    """A PodTemplateSpec merged onto the rendered pods; its spec is a PodSpec, checked at admission."""

    metadata: TemplateMeta = Field(default_factory=TemplateMeta)
    spec: KubeObject = Field(default_factory=dict)


class Toleration(Model):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class Resources(Model):
    """Kubernetes ResourceRequirements; quantities stay strings (`"1"`, `"8Gi"`, `google.com/tpu: 4`)."""

    requests: dict[str, str | int] = Field(default_factory=dict)
    limits: dict[str, str | int] = Field(default_factory=dict)
