"""`edgeinfer bench serve` argument handling and output files, against the loopback streaming server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from bench_sse_server import StreamServerSettings

from edgeinfer.bench.cli import add_arguments, run


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="edgeinfer bench")
    add_arguments(parser)
    return parser.parse_args(argv)


def test_serve_writes_json_and_table(
    stream_server: str,
    stream_settings: StreamServerSettings,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "r" / "result.json"
    args = _parse(["serve", "--base-url", stream_server, "--dataset", "shared-prefix", "--num-prompts", "8",
                   "--shared-prefix-groups", "2", "--shared-prefix-len", "12", "--random-input-len", "2:4",
                   "--random-output-len", "3", "--max-concurrency", "4", "--slo-ttft-ms", "10000",
                   "--api-key", "sk-test", "--num-warmups", "1", "--output-json", str(out), "--save-detailed",
                   "--no-progress"])  # fmt: skip
    assert run(args) == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["model"] == "stub-model"  # discovered from GET /v1/models
    assert "api_key" not in doc["config"]
    assert doc["summary"]["completed"] == 8 and doc["summary"]["goodput"] > 0
    assert len(doc["requests"]) == 8 and all(len(r["itl_ms"]) == 2 for r in doc["requests"])
    assert len(stream_settings.received) == 9  # one warm-up, then the eight measured
    assert all(r["headers"]["authorization"] == "Bearer sk-test" for r in stream_settings.received)
    table = capsys.readouterr().out
    assert "Successful requests:" in table and "Request goodput (req/s):" in table


def test_all_failures_exit_nonzero(tmp_path: Path) -> None:
    args = _parse(["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-prompts", "2",
                   "--num-warmups", "0", "--no-progress"])  # fmt: skip
    assert run(args) == 1


def test_unreachable_model_discovery_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(_parse(["serve", "--base-url", "http://127.0.0.1:9", "--no-progress"])) == 2
    assert "pass --model" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--request-rate", "0"], ["--random-input-len", "9:3"], ["--dataset", "x"]])
def test_bad_arguments_are_rejected_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        _parse(["serve", "--base-url", "http://x", *argv])
