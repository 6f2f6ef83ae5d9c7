"""Validate dashboard JSON against Grafana's JSON schema, vendored in ``dashboards/schema/``.

The dashboard is checked with ``dashboard.jsonschema.json``; each panel's ``options`` and
``fieldConfig.defaults.custom`` with its panel type's schema where one is vendored (timeseries,
stat, table, heatmap, bargauge: their ``Options`` and ``FieldConfig`` definitions); each query
with ``prometheus.jsonschema.json``. All files are registered in one ``referencing.Registry``
under their file names, so a ``$ref`` across files (``common.jsonschema.json#/...``) resolves
offline.

Errors come back as :class:`SchemaError` ``(path, message)``, the path a JSON pointer into the
dashboard. Where the schema offers alternatives (``oneOf``: a panel or a row, the table cell
options), the errors of the alternative that fits best are reported instead of one opaque "not
valid under any of the given schemas".
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

from jsonschema import Draft7Validator
from jsonschema.exceptions import ValidationError
from referencing import Registry
from referencing.jsonschema import DRAFT7

SCHEMA_DIR = Path(__file__).resolve().parent / "schema"
DASHBOARD_SCHEMA = "dashboard.jsonschema.json"
QUERY_SCHEMA = "prometheus.jsonschema.json"
#: Panel types with a vendored schema (``<type>.jsonschema.json``).
PANEL_SCHEMAS = ("timeseries", "stat", "table", "heatmap", "bargauge")


class SchemaError(NamedTuple):
    path: str
    message: str


@cache
def registry() -> Registry[Any]:
    """Every vendored schema, registered under its file name."""
    resources = [
        (p.name, DRAFT7.create_resource(json.loads(p.read_text(encoding="utf-8"))))
        for p in sorted(SCHEMA_DIR.glob("*.jsonschema.json"))
    ]
    result: Registry[Any] = Registry().with_resources(resources)
    return result


@cache
def _validator(ref: str) -> Draft7Validator:
    return Draft7Validator({"$ref": ref}, registry=registry())


def _definitions(schema_file: str) -> set[str]:
    contents = registry()[schema_file].contents
    return set(contents.get("definitions", {}))


def _leaves(error: ValidationError) -> list[ValidationError]:
    """The innermost errors; for ``oneOf``/``anyOf`` those of the best-fitting alternative."""
    if not error.context or error.validator not in ("oneOf", "anyOf"):
        return [error]
    branches: dict[Any, list[ValidationError]] = {}
    for sub in error.context:
        branches.setdefault(sub.schema_path[0], []).append(sub)
    if len(branches) < len(error.validator_value):
        return [error]  # some alternative matched: the error is the ambiguity itself
    best = min(branches.values(), key=len)
    return [leaf for sub in best for leaf in _leaves(sub)]


def _pointer(prefix: str, error: ValidationError) -> str:
    return prefix + "".join(f"/{p}" for p in error.absolute_path)


def _check(ref: str, instance: Any, prefix: str) -> Iterator[SchemaError]:
    for error in sorted(_validator(ref).iter_errors(instance), key=lambda e: list(e.path)):
        for leaf in _leaves(error):
            yield SchemaError(_pointer(prefix, leaf), leaf.message)


def _panels(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for i, panel in enumerate(dashboard.get("panels", [])):
        yield f"/panels/{i}", panel
        for j, inner in enumerate(panel.get("panels", [])):
            yield f"/panels/{i}/panels/{j}", inner


def validate(dashboard: dict[str, Any]) -> list[SchemaError]:
    """Every schema error of ``dashboard``, its panels and its queries."""
    errors = list(_check(DASHBOARD_SCHEMA, dashboard, ""))
    for path, panel in _panels(dashboard):
        kind = panel.get("type")
        if kind in PANEL_SCHEMAS:
            schema_file = f"{kind}.jsonschema.json"
            definitions = _definitions(schema_file)
            if "Options" in definitions and "options" in panel:
                errors += _check(f"{schema_file}#/definitions/Options", panel["options"],
                                 f"{path}/options")
            custom = panel.get("fieldConfig", {}).get("defaults", {}).get("custom")
            if "FieldConfig" in definitions and custom is not None:
                errors += _check(f"{schema_file}#/definitions/FieldConfig", custom,
                                 f"{path}/fieldConfig/defaults/custom")
        for k, target in enumerate(panel.get("targets", [])):
            errors += _check(QUERY_SCHEMA, target, f"{path}/targets/{k}")
    return errors
