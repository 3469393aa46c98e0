"""The Grafana dashboard (infra/grafana/scorefn-dashboard.json) queries only metrics a running server exports: a
renamed metric fails this test, not the dashboard."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.slow
DASHBOARD = Path(__file__).resolve().parents[2] / "infra" / "grafana" / "scorefn-dashboard.json"
METRIC = re.compile(r"\bscorefn_[a-z0-9_]+\b")
# The series a metric family of each type exposes (Prometheus' text format).
SERIES = {"counter": ("",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"), "info": ("",)}


def exported_series(url: str) -> set[str]:
    body = {"query": "a", "items": ["b"], "label_token_ids": [1]}  # one answered request: every family has samples
    assert httpx.post(url + "/v1/score", json=body, timeout=60).status_code == 200
    text = httpx.get(url + "/metrics", timeout=10).text
    return {name + suffix for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.MULTILINE)
            for suffix in SERIES.get(kind, ("",))}


def queries(dashboard: dict) -> list[str]:
    found = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    return found + [variable["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"]


def test_every_metric_a_panel_queries_is_exported_by_a_running_server(server):
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_series(server.url)
    used = {name for expr in queries(dashboard) for name in METRIC.findall(expr)}
    assert len(used) >= 20
    assert not used - exported, f"the dashboard queries metrics /metrics does not export: {sorted(used - exported)}"


def test_panels_read_the_chosen_data_source_and_instances_and_do_not_overlap():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "scorefn" and [v["name"] for v in dashboard["templating"]["list"]] == [
        "datasource", "instance"]
    cells = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["description"] and panel["targets"], panel["title"]
        assert all('instance=~"$instance"' in target["expr"] for target in panel["targets"]), panel["title"]
        box = panel["gridPos"]
        area = {(x, y) for x in range(box["x"], box["x"] + box["w"]) for y in range(box["y"], box["y"] + box["h"])}
        assert not area & cells and box["x"] + box["w"] <= 24, panel["title"]
        cells |= area
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
