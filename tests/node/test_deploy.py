"""The Grafana dashboard and the alert rules only use series a node really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SERIES = re.compile(r"\b((?:edgeinfer:|process_)[a-z0-9_]+)")
SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def _exported_families(node) -> set[str]:
    httpx.post(node.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 2})
    return {family.name for family in text_string_to_metric_families(httpx.get(node.url + "/metrics").text)}


def _family(series: str) -> str:
    for suffix in SUFFIXES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def _exprs() -> list[str]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "edgeinfer-node-alerts.yml").read_text())
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    dashboard = json.loads((DEPLOY / "grafana" / "edgeinfer-node.json").read_text())
    exprs += [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    return exprs


def test_deploy_files_reference_exported_series(shared_node) -> None:
    exported = _exported_families(shared_node)
    referenced = {_family(name) for expr in _exprs() for name in SERIES.findall(expr)}
    referenced -= {"edgeinfer:gpu_utilization_perc"}  # only exported where torch sees a GPU
    assert referenced, "no series found in the deploy files"
    assert referenced <= exported, sorted(referenced - exported)


def test_alerts_cover_the_required_signals() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "edgeinfer-node-alerts.yml").read_text())
    text = json.dumps(rules)
    for needle in (
        "request_outcomes_total",
        "time_to_first_token_seconds_bucket",
        "num_requests_waiting",
        "canary_events_total",
    ):
        assert needle in text, needle
