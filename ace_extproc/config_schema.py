"""``ace-extproc schema``: fleet.yaml's JSON Schema and its reference, generated from the
types of ``fleet_file`` (so neither can drift from what ``config`` accepts).

``ace-extproc schema`` prints the JSON Schema (for an editor, or a CI check of fleet
files); ``--markdown`` the reference. In a checkout, ``--write`` regenerates the shipped
copies: ``ace_extproc/fleet.schema.json``, ``docs/configuration.md`` and the fleet's
part of the Helm chart's ``values.schema.json``; ``--check`` fails if one is stale."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import msgspec

from ace_extproc import fleet_file as ff

PACKAGE = Path(__file__).resolve().parent
ROOT = PACKAGE.parent
SCHEMA_FILE = PACKAGE / "fleet.schema.json"
REFERENCE_FILE = ROOT / "docs" / "configuration.md"
CHART_SCHEMA_FILE = ROOT / "charts" / "ace-extproc" / "values.schema.json"
# The chart's schema is draft-07 (Helm's long-standing dialect): the fleet's definitions
# go under its "definitions", prefixed so a regeneration finds and replaces them.
CHART_PREFIX = "fleet."


def fleet_schema() -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of a fleet file."""
    (_,), defs = msgspec.json.schema_components([ff.FleetFile], ref_template="#/$defs/{name}")
    root = defs.pop("FleetFile")
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        **root,
        "title": "ace-extproc fleet file",
        "$defs": defs,
    }
    # JSON's types (lists, not tuples), and docstrings' line breaks made spaces.
    out: dict[str, Any] = json.loads(json.dumps(schema), object_hook=_one_line_descriptions)
    return out


def _one_line_descriptions(node: dict[str, Any]) -> dict[str, Any]:
    if isinstance(node.get("description"), str):
        node["description"] = " ".join(node["description"].split())
    return node


def chart_schema(chart: dict[str, Any]) -> dict[str, Any]:
    """The chart's values schema with its ``destinations`` and ``router`` checked as the
    fleet file's (its own settings left as they are)."""
    schema = fleet_schema()
    text = json.dumps({"props": schema["properties"], "defs": schema["$defs"]})
    text = text.replace('"#/$defs/', f'"#/definitions/{CHART_PREFIX}')
    fleet = json.loads(text)
    definitions = {
        k: v for k, v in chart.get("definitions", {}).items() if not k.startswith(CHART_PREFIX)
    }
    definitions.update({CHART_PREFIX + k: v for k, v in fleet["defs"].items()})
    router = fleet["props"]["router"]  # in the chart, a mapping (its values set some keys)
    router = next(r for r in router["anyOf"] if r.get("type") != "null")
    properties = dict(chart["properties"])
    properties["destinations"] = fleet["props"]["destinations"]
    properties["router"] = router
    return {**chart, "properties": properties, "definitions": definitions}


def dumps(value: Any, indent: int = 0, lead: int = 0, width: int = 100) -> str:
    """JSON with what fits on one line (``lead``: what precedes it there) on one line, as
    the chart's schema is written by hand."""
    flat = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, dict | list) or not value or indent + lead + len(flat) <= width:
        return flat
    pad = " " * (indent + 2)
    if isinstance(value, list):
        items = [pad + dumps(v, indent + 2, 0, width) for v in value]
        return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"
    items = []
    for k, v in value.items():
        key = json.dumps(k, ensure_ascii=False) + ": "
        items.append(pad + key + dumps(v, indent + 2, len(key), width))
    return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"


# ---------------------------------------------------------------- the reference

_PREFACE = """\
# Configuration reference

<!-- Generated from ace_extproc/fleet_file.py by `ace-extproc schema --write`: edit the
     types' descriptions there, not this file (tests/test_config.py checks it). -->

One YAML file, `fleet.yaml`, holds the fleet (`destinations:`) and the router's own
settings (`router:`); `ace-extproc serve --fleet fleet.yaml` and `ace-extproc
envoy-config --fleet fleet.yaml` read the same file. A key not listed here is an error
naming its path (`destinations[0].wieght: unknown field`), as is a value of the wrong
type or out of its bounds; `null` for a section means its defaults.

Its JSON Schema, generated from the same types, ships as
`ace_extproc/fleet.schema.json` (`ace-extproc schema` prints it): point an editor's YAML
support at it, or check fleet files in CI. An annotated example:
[envoy/fleet.example.yaml](../envoy/fleet.example.yaml).
"""


def reference() -> str:
    """docs/configuration.md: every key of every section, with its type, default and
    description, in the order a reader meets them."""
    schema = fleet_schema()
    defs: dict[str, dict[str, Any]] = schema["$defs"]
    sections: list[tuple[str, dict[str, Any]]] = [("fleet.yaml", schema)]
    titles: dict[str, str] = {}
    done = 0
    while done < len(sections):  # breadth first: each section's own come after it
        where, node = sections[done]
        done += 1
        for key, prop in node.get("properties", {}).items():
            for name, many in _refs(prop):
                if name not in titles and "properties" in defs[name]:
                    path = key if where == "fleet.yaml" else f"{where}.{key}"
                    title = path + ("[]" if many else "")
                    if _tag(defs[name]):
                        title += f" (type: {_tag(defs[name])})"
                    titles[name] = title
                    sections.append((title, defs[name]))
    out = [_PREFACE]
    for title, node in sections:
        out.append(f"\n## `{title}`\n")
        if desc := node.get("description"):
            out.append("\n" + _oneline(desc) + "\n")
        out.append("\n| key | type | default | description |\n| --- | --- | --- | --- |\n")
        required = set(node.get("required", ()))
        for key, prop in node["properties"].items():
            default = "required" if key in required else _value(prop.get("default"))
            if "enum" in prop and key == _tag_field(node):
                kind, default, text = f"`{prop['enum'][0]}`", "required", "Which kind."
            else:
                kind, text = _type(prop, defs, titles), prop.get("description", "")
                if not text and (ref := _refs(prop)):
                    text = _first_sentence(defs[ref[0][0]].get("description", ""))
            row = [f"`{key}`", kind, default, _oneline(text)]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |\n")
    return "".join(out)


def _refs(node: dict[str, Any], many: bool = False) -> list[tuple[str, bool]]:
    """The definitions ``node`` names, each with whether it is a list's item."""
    if "$ref" in node:
        return [(node["$ref"].rsplit("/", 1)[1], many)]
    found: list[tuple[str, bool]] = []
    for sub in node.get("anyOf", ()):
        found += _refs(sub, many)
    if "items" in node:
        found += _refs(node["items"], True)
    return found


def _tag_field(node: dict[str, Any]) -> str | None:
    """The key a tagged union's kind is named by (``type:``): a required constant."""
    properties: dict[str, dict[str, Any]] = node.get("properties", {})
    for key, prop in properties.items():
        if list(prop) == ["enum"] and len(prop["enum"]) == 1 and key in node.get("required", ()):
            return key
    return None


def _tag(node: dict[str, Any]) -> str | None:
    field = _tag_field(node)
    return str(node["properties"][field]["enum"][0]) if field else None


def _type(node: dict[str, Any], defs: dict[str, Any], titles: dict[str, str]) -> str:
    if "$ref" in node:
        name = node["$ref"].rsplit("/", 1)[1]
        if name in titles:
            return f"[{titles[name]}](#{_anchor(titles[name])})"
        return _type(defs[name], defs, titles)
    if "anyOf" in node:
        return " or ".join(_type(n, defs, titles) for n in node["anyOf"])
    if "enum" in node:
        return "one of " + ", ".join(f"`{v}`" for v in node["enum"])
    kind = node.get("type")
    if kind == "array":
        text = "list of " + _type(node["items"], defs, titles)
        return text + (f" (at least {node['minItems']})" if "minItems" in node else "")
    if kind == "object":
        keys = "non-empty string" if node.get("propertyNames") else "string"
        value = _type(node.get("additionalProperties", {}), defs, titles)
        return f"mapping of {keys} to {value}"
    words = {"string": "string", "integer": "integer", "number": "number", "boolean": "boolean"}
    text = words.get(str(kind), str(kind))
    bounds = [
        f"{op} {node[key]}"
        for key, op in (
            ("minimum", ">="),
            ("exclusiveMinimum", ">"),
            ("maximum", "<="),
            ("exclusiveMaximum", "<"),
        )
        if key in node
    ]
    if node.get("minLength") == 1:
        text = "non-empty " + text
    if "pattern" in node:
        text = ff.PATTERN_WORDS.get(node["pattern"], f"string matching `{node['pattern']}`")
    return text + (" " + ", ".join(bounds) if bounds else "")


def _value(value: Any) -> str:
    if value is None:
        return "none"
    return f"`{json.dumps(value)}`" if value != "" else '`""`'


def _oneline(text: str) -> str:
    # Markdown would take <id> for an HTML tag.
    return " ".join(text.split()).replace("<", "\\<")


def _first_sentence(text: str) -> str:
    return _oneline(text).split(". ")[0].rstrip(".") + "."


def _anchor(title: str) -> str:
    """The anchor GitHub gives a heading of ``title`` in backticks."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


# ---------------------------------------------------------------- the command


def generated() -> dict[Path, str]:
    """Each shipped file and what the types make of it now."""
    out = {
        SCHEMA_FILE: dumps(fleet_schema()) + "\n",
        REFERENCE_FILE: reference(),
    }
    if CHART_SCHEMA_FILE.is_file():
        chart = json.loads(CHART_SCHEMA_FILE.read_text())
        out[CHART_SCHEMA_FILE] = dumps(chart_schema(chart)) + "\n"
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--markdown", action="store_true", help="print the configuration reference instead"
    )
    what = parser.add_mutually_exclusive_group()
    what.add_argument(
        "--write", action="store_true", help="in a checkout: regenerate the shipped files"
    )
    what.add_argument(
        "--check", action="store_true", help="in a checkout: fail if a shipped file is stale"
    )


def run(args: argparse.Namespace) -> int:
    if not (args.write or args.check):
        sys.stdout.write(reference() if args.markdown else dumps(fleet_schema()) + "\n")
        return 0
    if not REFERENCE_FILE.parent.is_dir():
        print(f"error: {ROOT} is not a checkout (no docs/)", file=sys.stderr)
        return 2
    stale = []
    for path, text in generated().items():
        if not path.is_file() or path.read_text() != text:
            stale.append(path.relative_to(ROOT))
            if args.write:
                path.write_text(text)
    for path in stale:
        print(f"{'wrote' if args.write else 'stale'}: {path}", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m ace_extproc.config_schema")
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
