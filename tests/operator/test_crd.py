"""The CRD: generated from the pydantic model, structural, committed, and it accepts our examples."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from diloco.operator import crd
from diloco.operator.admission import immutable

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = [ROOT / "crds" / "decoupleddilocojobs.diloco.dev.yaml",
             ROOT / "charts" / "decoupled-diloco" / "crds" / "decoupleddilocojobs.diloco.dev.yaml"]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
FORBIDDEN = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "const", "title", "default"}


def walk(node: Any, path: str = "") -> Any:
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            yield from walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from walk(value, f"{path}[{i}]")


def schema() -> dict[str, Any]:
    return crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def json_schema(node: Any) -> Any:
    """OpenAPI 3.0 -> JSON Schema draft 4 (same exclusive bounds), failing on unknown fields like
    `kubectl apply --validate=strict`, the default since Kubernetes 1.27."""
    if isinstance(node, list):
        return [json_schema(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: json_schema(v) for k, v in node.items() if k != "nullable" and not k.startswith("x-kubernetes")}
    if node.get("x-kubernetes-int-or-string"):
        out["type"] = ["integer", "string"]
    if node.get("nullable"):
        out["type"] = [node["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    if "properties" in node and not node.get("x-kubernetes-preserve-unknown-fields"):
        out.setdefault("additionalProperties", False)
    return out


def validator() -> jsonschema.Draft4Validator:
    s = json_schema(schema())
    s["properties"]["metadata"] = {"type": "object"}
    return jsonschema.Draft4Validator(s)


def test_committed_crd_equals_generated() -> None:
    generated = crd.render_yaml()
    for path in COMMITTED:
        assert path.read_text() == generated, f"{path} is stale: run `diloco crd > {path.relative_to(ROOT)}`"
    cli = subprocess.run([sys.executable, "-P", "-m", "diloco.apps.cli", "crd"], capture_output=True, text=True, check=True,
                         cwd=ROOT / "tests")
    assert cli.stdout == generated


def test_schema_is_structural() -> None:
    for path, node in walk(schema()):
        if path.endswith(".properties") or path.endswith(".additionalPrinterColumns") or \
                ".x-kubernetes-validations" in path:  # CEL rules, not schema nodes
            continue
        assert not FORBIDDEN & set(node), (path, FORBIDDEN & set(node))
        if "properties" in node:
            assert node.get("type") == "object", path
        assert node.get("additionalProperties") is not False, path
        if "type" not in node and not path.endswith("properties"):
            assert node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields"), path
    groups = schema()["properties"]["spec"]["properties"]["learnerGroups"]
    assert groups["x-kubernetes-list-type"] == "map" and groups["x-kubernetes-list-map-keys"] == ["name"]
    # The status is structural too (the server prunes what JobStatus lacks); only the spec values
    # recorded in startedSpec.fields are free-form.
    kept = [path for path, node in walk(schema()["properties"]["status"]) if node.get("x-kubernetes-preserve-unknown-fields")]
    assert kept == [".properties.startedSpec.properties.fields"]
    conditions = schema()["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == ["type"]
    undocumented = [path for path, node in walk(schema()["properties"]["status"])
                    if path.split(".")[-2:-1] == ["properties"] and "description" not in node]
    assert not undocumented, f"status fields without a description (kubectl explain): {undocumented}"


def test_cel_rules_guard_the_immutable_fields_and_can_be_left_out() -> None:
    rules = schema()["properties"]["spec"]["x-kubernetes-validations"]
    assert [r["message"].split(" ", 1)[0] for r in rules] == [f"spec.{p}" for p in immutable.FIELDS]
    assert all("oldSelf" in r["rule"] and "create a new job" in r["message"] for r in rules)
    assert "x-kubernetes-validations" not in crd.crd(cel=False)["spec"]["versions"][0]["schema"][
        "openAPIV3Schema"]["properties"]["spec"]
    assert "x-kubernetes-validations" not in crd.render_yaml(cel=False)


def test_crd_metadata_and_printer_columns() -> None:
    c = crd.crd()
    assert c["metadata"]["name"] == "decoupleddilocojobs.diloco.dev"
    version = c["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}} and c["spec"]["names"]["shortNames"] == ["ddj"]
    assert [col["name"] for col in version["additionalPrinterColumns"]] == ["Phase", "Learners", "Progress", "ETA",
                                                                            "Version", "Goodput", "Age"]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_examples_validate_against_the_crd_schema(path: Path) -> None:
    validator().validate(yaml.safe_load(path.read_text()))


@pytest.mark.parametrize("breakage, where", [
    (lambda s: s["learnerGroups"][0].update(replicas="two"), "spec.learnerGroups.0.replicas"),
    (lambda s: s["learnerGroups"][0].update(replica=2), "spec.learnerGroups.0"),
    (lambda s: s["learnerGroups"][0].update(name="Local_Group"), "spec.learnerGroups.0.name"),
    (lambda s: s.setdefault("syncer", {}).update(compression="int2"), "spec.syncer.compression"),
    (lambda s: s.setdefault("syncer", {}).update(outerLearningRate=0), "spec.syncer.outerLearningRate"),
    (lambda s: s.update(learnerGroups=[]), "spec.learnerGroups"),
])
def test_a_broken_manifest_fails_with_its_path(breakage: Any, where: str) -> None:
    manifest = yaml.safe_load(EXAMPLES[0].read_text())
    broken = copy.deepcopy(manifest)
    breakage(broken["spec"])
    errors = list(validator().iter_errors(broken))
    assert errors and any(".".join(map(str, e.absolute_path)) == where for e in errors), \
        [(list(e.absolute_path), e.message) for e in errors]
