"""`edgeinfer fleet simulate`: the report folder, a fleet-size sweep, bad scenarios; and the geography."""

from __future__ import annotations

import json

import pytest

from edgeinfer.cli import main
from edgeinfer.fleet.sim_geo import Metro, world_metros
from edgeinfer.router.geo import NetworkModel

SCENARIO = """
seed = 4
duration_s = 90.0
[locations]
source = "list"
sites = [
  { code = "FRA", lat = 50.03, lon = 8.57, population = 5 },
  { code = "AMS", lat = 52.31, lon = 4.76, population = 3 },
  { code = "SIN", lat = 1.36, lon = 103.99, population = 4 },
]
[demand]
requests_per_s = 4.0
[[models]]
name = "m"
profile = "m"
output_tokens = { median = 16, max = 64 }
[nodes]
profile = "p.json"
accelerators = 4
"""

PROFILE = {
    "device": "test",
    "source": "fixed",
    "models": {
        "m": dict(
            prefill_tok_s=4000.0,
            prefill_overhead_ms=5.0,
            step_base_ms=20.0,
            step_per_seq_ms=1.0,
            step_per_kctx_ms=0.5,
            load_s=3.0,
            weights_gb=1.0,
            kv_tokens=50_000,
            kv_gb=1.0,
        )
    },
}


@pytest.fixture
def scenario(tmp_path):
    (tmp_path / "p.json").write_text(json.dumps(PROFILE))
    path = tmp_path / "s.toml"
    path.write_text(SCENARIO)
    return path


def test_simulate_writes_report_and_plots(scenario, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["fleet", "simulate", "--scenario", str(scenario), "--out", str(out), "--no-progress"]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    assert list(metrics) == ["router", "nearest", "least-loaded", "round-robin"]
    for m in metrics.values():
        assert m["served"] + m["rejected"] == m["requests"] > 200
        assert m["ttft_p50_ms"] <= m["ttft_p99_ms"] <= m["e2e_p99_ms"]
    # Nearest-first policies keep Frankfurt's and Amsterdam's clients in Europe; round-robin does not.
    assert metrics["router"]["within_pct"] > metrics["round-robin"]["within_pct"]
    report = (out / "report.md").read_text()
    assert report.count("\n| ") == 5 and "| round-robin |" in report
    for png in ("ttft_cdf.png", "world_map.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| router |" in capsys.readouterr().out


def test_sweep_finds_accelerators_for_the_slo(scenario, tmp_path):
    out = tmp_path / "sweep"
    argv = ["fleet", "simulate", "--scenario", str(scenario), "--out", str(out), "--no-progress"]
    assert main([*argv, "--no-plots", "--accelerators", "3,6", "--policies", "router,nearest"]) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert set(sweep) == {"3", "6"}
    assert sweep["6"]["router"]["accelerators"] == 6
    assert "**needed**" in (out / "sweep.md").read_text()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (SCENARIO + "bogus = 1\n", "[nodes]: unknown keys ['bogus']"),  # the last table is [nodes]
        ("policies = ['fastest']\n" + SCENARIO, "unknown policies ['fastest']"),
    ],
)
def test_bad_scenario_is_one_line_and_exit_2(tmp_path, capsys, text, message):
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    assert main(["fleet", "simulate", "--scenario", str(bad), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0


def test_rtt_from_great_circle():
    london = Metro(code="L", name="", lat=51.51, lon=-0.13, population=1, region="EU", utc_offset_h=0)
    new_york = Metro(code="N", name="", lat=40.71, lon=-74.01, population=1, region="NA", utc_offset_h=-5)
    # ~5,570 km; 2 x 5,570 / 199.86 km per ms x 2.0 + 5 ms.
    assert NetworkModel(path_inflation=2.0, last_mile_ms=5.0).rtt_ms(london, new_york) == pytest.approx(
        116.5, abs=1.0
    )


def test_world_metros_are_distinct_big_cities():
    metros = world_metros(300)
    assert len(metros) == len({m.code for m in metros}) == 300
    names = {m.name for m in metros}
    assert {"Tokyo", "London", "New York City", "São Paulo", "Lagos"} <= names
    assert {m.region for m in metros} >= {"AS", "EU", "NA", "SA", "AF", "OC"}
