"""The CustomResourceDefinition, generated from the same pydantic model that validates jobs.

One source of truth: the API server, the operator and `diloco run` all accept exactly
what `JobSpec` accepts. Pydantic emits JSON Schema 2020-12; Kubernetes wants a *structural*
OpenAPI v3.0 schema, so `structural()` inlines `$ref`s, turns `X | None` into `nullable`,
`str | int` into `x-kubernetes-int-or-string`, and drops what structural schemas forbid.
Defaults move into descriptions: the operator applies them, and stored objects stay as written.
CEL transition rules (`x-kubernetes-validations`, Kubernetes 1.25+; alpha behind a feature gate
in 1.23-1.24) refuse edits of the fields a running job cannot change (operator/admission/immutable.py). Older API
servers drop the field, but `kubectl apply`'s client-side validation against them rejects the
CRD: render it with `cel=False` (`diloco crd --no-cel`) for those; the operator's own check
(status.startedSpec) holds either way.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import TYPE_CHECKING, Any

import yaml

from diloco.operator.admission.immutable import FIELDS as IMMUTABLE
from diloco.spec import API_VERSION, KIND, JobSpec, JobStatus

if TYPE_CHECKING:
    from diloco.operator.kube import Kube

GROUP, VERSION = API_VERSION.split("/")
PLURAL = "decoupleddilocojobs"
SINGULAR = "decoupleddilocojob"
SHORT_NAMES = ["ddj"]
CRD_NAME = f"{PLURAL}.{GROUP}"

PRINTER_COLUMNS = [
    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
    {"name": "Learners", "type": "string", "jsonPath": ".status.learners",
     "description": "Ready learners out of desired"},
    {"name": "Progress", "type": "string", "jsonPath": ".status.progress",
     "description": "How far toward spec.training's bound (tokenBudget, steps or durationSeconds)"},
    {"name": "ETA", "type": "string", "jsonPath": ".status.eta",
     "description": "About how long until the bound, at the recent rate"},
    {"name": "Version", "type": "integer", "jsonPath": ".status.outerVersion",
     "description": "Sum of the global fragments' versions"},
    {"name": "Goodput", "type": "number", "jsonPath": ".status.goodput",
     "description": "Share of desired learner-time spent training"},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]

# Keys that mean nothing to the API server or that structural schemas refuse.
_DROP = {"title", "$defs", "default", "additionalProperties", "const", "exclusiveMinimum",
         "exclusiveMaximum", "anyOf", "$ref"}


def structural(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rewrite one pydantic JSON Schema node (and its children) into a structural schema."""
    defs = schema.get("$defs", {}) if defs is None else defs
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        return structural({**target, **{k: v for k, v in schema.items() if k != "$ref"}}, defs)
    out: dict[str, Any] = {}
    variants = schema.get("anyOf", [])
    non_null = [v for v in variants if v.get("type") != "null"]
    if variants and sorted(v.get("type", "") for v in non_null) == ["integer", "string"]:
        out["x-kubernetes-int-or-string"] = True
    elif variants:
        if len(non_null) != 1:
            raise ValueError(f"cannot express anyOf {variants!r} in a structural schema")
        out.update(structural(non_null[0], defs))
        if len(non_null) < len(variants):
            out["nullable"] = True
    for key, value in schema.items():
        if key in _DROP:
            continue
        if key == "properties":
            out[key] = {name: structural(sub, defs) for name, sub in value.items()}
        elif key == "items":
            out[key] = structural(value, defs)
        else:
            out[key] = value
    if "const" in schema:
        out["enum"] = [schema["const"]]
    for bound, plain in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if bound in schema:  # JSON Schema 2020-12 number -> OpenAPI 3.0 boolean flag
            out[plain], out[bound] = schema[bound], True
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):  # a map (nodeSelector, requests); `false` is pruning, the default
        out["additionalProperties"] = structural(extra, defs)
    if "default" in schema and schema["default"] is not None:
        note = f"Default: {json.dumps(schema['default'])}."
        out["description"] = f"{out['description']} {note}" if "description" in out else note
    first = [k for k in ("type", "description") if k in out]
    return {k: out[k] for k in first + [k for k in out if k not in first]}


def _present(obj: str, path: str) -> str:
    parts = path.split(".")
    return " && ".join(f"has({obj}.{'.'.join(parts[:i + 1])})" for i in range(len(parts)))


def immutable_rules() -> list[dict[str, str]]:
    """One CEL transition rule per immutable field, on `spec`: set, unset or changed, it is refused
    unless the job was suspended (a queued job that never ran may still be edited; the operator
    refuses it then if the job had started before: operator/admission/immutable.py)."""
    rules = []
    for path, why in IMMUTABLE.items():
        new, old = _present("self", path), _present("oldSelf", path)
        rule = (f"(has(oldSelf.suspend) && oldSelf.suspend) || (({new}) == ({old}) && "
                f"(!({new}) || self.{path} == oldSelf.{path}))")
        rules.append({"rule": rule, "message": f"spec.{path} cannot change while the job runs ({why}); "
                                               "create a new job, or revert the change"})
    return rules


def spec_schema(cel: bool = True) -> dict[str, Any]:
    """`spec` of the custom resource; learner groups are a map keyed by name (unique, SSA-mergeable)."""
    schema = structural(JobSpec.model_json_schema(by_alias=True, mode="validation"))
    groups = schema["properties"]["learnerGroups"]
    groups["x-kubernetes-list-type"] = "map"
    groups["x-kubernetes-list-map-keys"] = ["name"]
    if cel:
        schema["x-kubernetes-validations"] = immutable_rules()
    return schema


def _empty_strings_allowed(node: dict[str, Any]) -> dict[str, Any]:
    """Plain strings marked nullable: Kubernetes 1.20's validator (go-openapi's) takes an empty
    string for null and refuses it unless the field is nullable, and the status has empty ones (a
    condition's message, an endpoint not known yet). The operator never writes null (JobStatus
    refuses it); newer servers read `nullable` as just that."""
    plain = node.get("type") == "string" and not {"enum", "pattern", "format", "minLength"} & set(node)
    out = {k: _empty_strings_allowed(v) if k in ("items", "additionalProperties") and isinstance(v, dict) else v
           for k, v in node.items()}
    if "properties" in node:
        out["properties"] = {name: _empty_strings_allowed(sub) for name, sub in node["properties"].items()}
    return {**out, "nullable": True} if plain else out


def status_schema() -> dict[str, Any]:
    """`status`, from JobStatus: structural, so the API server prunes what it lacks (and `kubectl
    explain ddj.status` documents it); only startedSpec.fields, spec values, stays free-form."""
    return _empty_strings_allowed(structural(JobStatus.model_json_schema(by_alias=True, mode="validation")))


def crd(cel: bool = True) -> dict[str, Any]:
    """The whole CustomResourceDefinition as plain data."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": CRD_NAME, "labels": {"app.kubernetes.io/part-of": "decoupled-diloco"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {"plural": PLURAL, "singular": SINGULAR, "kind": KIND, "listKind": f"{KIND}List",
                      "shortNames": SHORT_NAMES, "categories": ["diloco"]},
            "versions": [{
                "name": VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A Decoupled DiLoCo training job: learner groups and one syncer.",
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema(cel),
                        # Written by the operator alone: kopf keeps its state in annotations.
                        "status": status_schema(),
                    },
                }},
            }],
        },
    }


def render_yaml(cel: bool = True) -> str:
    return yaml.safe_dump(crd(cel), sort_keys=False, allow_unicode=True, width=100)


# `diloco crd --apply`: the chart's opt-in CRD-upgrade hook Job (values `crds.upgrade`) runs it.
FIELD_MANAGER = "diloco-crd"
CEL_SINCE = (1, 23)  # x-kubernetes-validations is in the CRD API from 1.23; older servers refuse to apply it


def server_version(kube: Kube) -> tuple[int, int]:
    """(major, minor) of the API server; managed clusters write minors like "28+"."""
    info = kube.request("GET", "version")
    return int(info["major"]), int(re.sub(r"\D.*", "", info["minor"]))


def apply(kube: Kube, cel: bool = True) -> tuple[dict[str, Any], bool]:
    """Server-side apply the CRD (creates or updates it, taking over fields Helm or kubectl set);
    returns the server's object and whether the CEL rules went with it."""
    cel = cel and server_version(kube) >= CEL_SINCE
    from diloco.operator.kube import APPLY_PATCH

    obj = kube.request("PATCH", f"apis/apiextensions.k8s.io/v1/customresourcedefinitions/{CRD_NAME}", crd(cel),
                       params={"fieldManager": FIELD_MANAGER, "force": "true"}, content_type=APPLY_PATCH)
    return obj, cel


def main(args: argparse.Namespace) -> int:
    cel = not getattr(args, "no_cel", False)
    if not getattr(args, "apply", False):
        sys.stdout.write(render_yaml(cel=cel))
        return 0
    from diloco.operator.kube import ApiError, Kube

    try:
        obj, cel = apply(Kube.connect(), cel)
    except ApiError as exc:
        print(f"diloco crd --apply: {exc}", file=sys.stderr)
        return 1
    print(f"customresourcedefinition {CRD_NAME} applied (resourceVersion {obj['metadata'].get('resourceVersion')}, "
          f"CEL rules {'on' if cel else 'off'})")
    return 0
