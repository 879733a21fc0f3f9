"""The router's Grafana dashboard is valid JSON and only uses series a live router exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from helpers.router_fleet import RouterThread
from prometheus_client.parser import text_string_to_metric_families

from edgeinfer.router.config import RouterConfig
from edgeinfer.router.fleet_file import parse_fleet

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "edgeinfer-router.json"
SERIES = re.compile(r"\b(edgeinfer_router:[a-z0-9_]+)")
SUFFIXES = ("_total", "_bucket", "_count", "_sum")


def _family(series: str) -> str:
    return next((series[: -len(s)] for s in SUFFIXES if series.endswith(s)), series)


def _exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", [])]
    exprs += [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def test_dashboard_series_exist_on_a_live_router(tmp_path: Path) -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    rows = [p["title"] for p in dashboard["panels"] if p["type"] == "row"]
    assert rows == ["Edge router", "Tenants (fleet limits)"]
    fleet = parse_fleet({"locations": [{"code": "FRA", "lat": 50.0, "lon": 8.5, "nodes": []}]})
    router = RouterThread(RouterConfig(location="FRA", placement=None), fleet).start()
    try:
        httpx.post(router.url + "/v1/completions", json={"model": "tiny", "prompt": "Hi"}, timeout=10)
        text = httpx.get(router.url + "/metrics", timeout=10).text
    finally:
        router.stop()
    exported = {family.name for family in text_string_to_metric_families(text)}
    referenced = {_family(name) for expr in _exprs(dashboard) for name in SERIES.findall(expr)}
    assert len(referenced) >= 8, referenced
    assert referenced <= exported, sorted(referenced - exported)
