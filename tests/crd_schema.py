"""Custom resources checked against their CRDs (``tests/crds/``, see its README): the
version's ``openAPIV3Schema`` as a JSON schema, with unknown fields refused (the API
server's strict field validation) unless the schema preserves them."""

from __future__ import annotations

import copy
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import yaml

CRDS = Path(__file__).resolve().parent / "crds"


def _strict(node: Any) -> Any:
    if isinstance(node, dict):
        if (
            node.get("type") == "object"
            and "properties" in node
            and "additionalProperties" not in node
            and not node.get("x-kubernetes-preserve-unknown-fields")
        ):
            node["additionalProperties"] = False
        for value in node.values():
            _strict(value)
    elif isinstance(node, list):
        for value in node:
            _strict(value)
    return node


@cache
def _schemas() -> dict[tuple[str, str], dict[str, Any]]:
    """(apiVersion, kind) -> the schema of that version of the resource."""
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for path in sorted(CRDS.glob("*.yaml")):
        for crd in yaml.safe_load_all(path.read_text()):
            if not crd or crd.get("kind") != "CustomResourceDefinition":
                continue
            spec = crd["spec"]
            for version in spec["versions"]:
                schema = _strict(copy.deepcopy(version["schema"]["openAPIV3Schema"]))
                # The API server's fields, not the CRD's to describe (Istio's leave
                # them out).
                properties = schema.setdefault("properties", {})
                properties["metadata"] = {"type": "object"}
                properties.setdefault("apiVersion", {"type": "string"})
                properties.setdefault("kind", {"type": "string"})
                api_version = f"{spec['group']}/{version['name']}"
                out[(api_version, spec["names"]["kind"])] = schema
    return out


def validate(doc: dict[str, Any]) -> None:
    """Raise ``jsonschema.ValidationError`` where ``doc`` breaks its CRD's schema
    (``KeyError`` for a kind no CRD here describes)."""
    schema = _schemas()[(doc["apiVersion"], doc["kind"])]
    jsonschema.Draft7Validator(schema).validate(doc)


def describes(doc: dict[str, Any]) -> bool:
    """Whether a CRD here describes ``doc``'s kind."""
    return (doc.get("apiVersion"), doc.get("kind")) in _schemas()


def assert_refused(doc: dict[str, Any], path: list[Any], value: Any) -> None:
    """``doc`` passes its CRD, and fails it once ``value`` is set at ``path`` (the
    check bites)."""
    validate(doc)
    broken = copy.deepcopy(doc)
    node: Any = broken
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    try:
        validate(broken)
    except jsonschema.ValidationError:
        return
    raise AssertionError(f"{doc['kind']} with {path} = {value!r} passed its CRD")
