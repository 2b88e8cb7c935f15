"""Static checks of the Grafana dashboard and its provisioning files.

NOTE: the schema. Grafana publishes no JSON Schema of the dashboard model on PyPI or npm
(``@grafana/schema`` ships TypeScript types generated from CUE), so :data:`DASHBOARD_SCHEMA` is a
focused JSON Schema of what Grafana needs to import and render this dashboard: ``title``, ``uid``
(Grafana's 40-character limit), ``schemaVersion``, the templating list, and for every panel its
``type``, ``gridPos`` (24-column grid), ``datasource`` reference and ``targets`` (``refId`` +
``expr``); row panels carry neither datasource nor targets. The PromQL itself is checked against
a live Prometheus in ``test_deploy_prometheus.py``.
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "moeserve.json"
RECORDING = DEPLOY / "prometheus" / "rules" / "recording.yml"

DATASOURCE_REF = {
    "type": "object",
    "required": ["type", "uid"],
    "properties": {"type": {"const": "prometheus"}, "uid": {"type": "string", "minLength": 1}},
}
DASHBOARD_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "templating", "time"],
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "uid": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 36},  # datasource refs are {type, uid}
        "version": {"type": "integer"},
        "editable": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "refresh": {"type": ["string", "boolean"]},
        "time": {
            "type": "object",
            "required": ["from", "to"],
            "properties": {"from": {"type": "string"}, "to": {"type": "string"}},
        },
        "templating": {
            "type": "object",
            "required": ["list"],
            "properties": {
                "list": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "type"],
                        "properties": {
                            "name": {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"},
                            "type": {"enum": ["query", "datasource", "custom", "constant", "interval"]},
                        },
                    },
                }
            },
        },
        "panels": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/panel"}},
    },
    "$defs": {
        "gridPos": {
            "type": "object",
            "required": ["h", "w", "x", "y"],
            "properties": {
                "h": {"type": "integer", "minimum": 1},
                "w": {"type": "integer", "minimum": 1, "maximum": 24},
                "x": {"type": "integer", "minimum": 0, "maximum": 23},
                "y": {"type": "integer", "minimum": 0},
            },
            "additionalProperties": False,
        },
        "target": {
            "type": "object",
            "required": ["refId", "expr"],
            "properties": {
                "refId": {"type": "string", "pattern": "^[A-Z]+$"},
                "expr": {"type": "string", "minLength": 1},
                "legendFormat": {"type": "string"},
                "datasource": DATASOURCE_REF,
            },
        },
        "panel": {
            "type": "object",
            "required": ["id", "type", "title", "gridPos"],
            "properties": {
                "id": {"type": "integer", "minimum": 1},
                "type": {
                    "enum": ["row", "timeseries", "stat", "gauge", "bargauge", "table", "heatmap", "text"]
                },
                "title": {"type": "string", "minLength": 1},
                "description": {"type": "string"},
                "gridPos": {"$ref": "#/$defs/gridPos"},
                "fieldConfig": {
                    "type": "object",
                    "required": ["defaults", "overrides"],
                    "properties": {"defaults": {"type": "object"}, "overrides": {"type": "array"}},
                },
            },
            "if": {"properties": {"type": {"const": "row"}}},
            "then": {
                "required": ["collapsed", "panels"],
                "properties": {"collapsed": {"type": "boolean"}, "panels": {"type": "array"}},
                "not": {"required": ["targets"]},
            },
            "else": {
                "required": ["datasource", "targets", "fieldConfig"],
                "properties": {
                    "datasource": DATASOURCE_REF,
                    "targets": {"type": "array", "minItems": 1, "items": {"$ref": "#/$defs/target"}},
                },
            },
        },
    },
}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def validate(doc: dict) -> None:
    jsonschema.Draft202012Validator(DASHBOARD_SCHEMA).validate(doc)


def test_schema_is_valid_and_rejects_broken_dashboards(dashboard: dict) -> None:
    jsonschema.Draft202012Validator.check_schema(DASHBOARD_SCHEMA)
    broken = []
    for path in (("panels", 1, "gridPos"), ("panels", 1, "targets"), ("panels", 1, "datasource"), ("uid",)):
        doc = copy.deepcopy(dashboard)
        *parents, key = path
        node = doc
        for p in parents:
            node = node[p]
        del node[key]
        broken.append(doc)
    doc = copy.deepcopy(dashboard)
    doc["panels"][1]["gridPos"]["w"] = 25
    broken.append(doc)
    for doc in broken:
        with pytest.raises(jsonschema.ValidationError):
            validate(doc)


def test_dashboard_validates(dashboard: dict) -> None:
    validate(dashboard)


def test_panels_have_unique_ids_and_do_not_overlap(dashboard: dict) -> None:
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = p["title"]
        refs = [t["refId"] for t in p.get("targets", [])]
        assert len(refs) == len(set(refs)), p["title"]


def test_datasource_and_variables(dashboard: dict) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in dashboard["panels"]:
        if p["type"] == "row":
            continue
        for ref in [p["datasource"]] + [t["datasource"] for t in p["targets"] if "datasource" in t]:
            assert ref == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        for t in p["targets"]:
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval", "__interval"}
            assert used <= set(variables), (p["title"], used)


def test_panels_cover_the_recording_rules(dashboard: dict) -> None:
    """Every recording rule meant for display has a panel; every rule a panel names exists."""
    rules = {r["record"] for g in yaml.safe_load(RECORDING.read_text())["groups"] for r in g["rules"]}
    exprs = " ".join(t["expr"] for p in dashboard["panels"] for t in p.get("targets", []))
    used = set(re.findall(r"\b[a-z_]+:[a-z_]+:[a-z0-9_]+\b", exprs))
    assert used <= rules, used - rules
    # Not displayed: 1h alert baselines and the summed bucket rates the quantiles are built from.
    shown = {r for r in rules if not r.endswith("_rate1h") and not r.startswith("job_le:")}
    assert shown <= used, shown - used
    for raw in (
        "moeserve_requests_running",
        "moeserve_requests_waiting",
        "moeserve_prompt_tokens_total",
        "moeserve_generation_tokens_total",
        "moeserve_expert_transfer_bytes_total",
        "moeserve_eamc_entries",
    ):
        assert raw in exprs, raw


def test_operations_doc_describes_every_panel(dashboard: dict) -> None:
    """docs/operations.md's dashboard table has a row per panel, by title, and no row for a panel
    that is gone."""
    doc = (DEPLOY.parent / "docs" / "operations.md").read_text()
    section = doc.split("## The dashboard", 1)[1].split("\n## ", 1)[0]
    rows = {m.strip() for m in re.findall(r"^\| ([^|]+) \|", section, re.M)} - {"panel", "---"}
    titles = {p["title"] for p in dashboard["panels"] if p["type"] != "row"}
    assert titles == rows, (titles - rows, rows - titles)


def test_provisioning_files() -> None:
    prov = DEPLOY / "grafana" / "provisioning"
    ds = yaml.safe_load((prov / "datasources" / "prometheus.yml").read_text())
    assert ds["apiVersion"] == 1
    (prom,) = ds["datasources"]
    assert prom["type"] == "prometheus" and prom["url"].startswith("http://")
    boards = yaml.safe_load((prov / "dashboards" / "moeserve.yml").read_text())
    assert boards["apiVersion"] == 1
    (provider,) = boards["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
