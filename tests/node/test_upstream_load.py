"""Upstream members report the upstream's own load: a real llama-server's queue reaches our `/metrics`,
the fleet status and `rejectIfBusy`, exactly as a local engine's does."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from helpers.node_servers import free_port

from edgeinfer.pool.upstream_stats import parse_metrics, parse_slots

_PEERS = Path(__file__).resolve().parents[2] / "bench" / "peers.py"


def _llama_server_binary() -> Path:
    spec = importlib.util.spec_from_file_location("bench_peers_for_upstream", _PEERS)
    assert spec is not None and spec.loader is not None
    peers = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = peers
    spec.loader.exec_module(peers)
    return peers.binary("llama-server")


@pytest.fixture
def llama_server(default_gguf, tmp_path_factory) -> Iterator[str]:
    """llama-server with one slot and its Prometheus metrics on, serving the Gemma 3 270M GGUF."""
    binary = _llama_server_binary()
    if not binary.exists():
        pytest.skip(f"llama-server is not built at {binary} (python bench/peers.py build)")
    port = free_port()
    log = tmp_path_factory.mktemp("llama-server") / "server.log"
    argv = [str(binary), "--model", str(default_gguf), "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--parallel", "1", "--ctx-size", "1024", "--threads", "1", "--metrics", "--no-webui"]
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ})
    url = f"http://127.0.0.1:{port}"
    try:
        _until(lambda: _health(url), 120, lambda: log.read_text(errors="replace")[-2000:], proc)
        yield url
    finally:
        proc.kill()  # SIGTERM waits for the queued generations to finish
        proc.wait(30)


def _health(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _until(check, timeout_s: float, why=lambda: "", proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"process exited: {why()}")
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {why()}")
        time.sleep(0.05)


def _gauge(node_url: str, name: str, model: str) -> float | None:
    for line in httpx.get(node_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'{name}{{model="{model}"}}'):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_llama_server_queue_reaches_metrics_status_and_reject_if_busy(llama_server, node_factory) -> None:
    node = node_factory({}, upstreams={"llama": llama_server}, preload=("llama",))
    # Other clients of the same llama-server fill its one slot and queue behind it.
    body = {"prompt": "Once upon a time", "n_predict": 400, "ignore_eos": True}

    def load() -> None:
        # the server is stopped under the queued requests at the end of the module
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(llama_server + "/completion", json=body, timeout=300)

    clients = [threading.Thread(target=load, daemon=True) for _ in range(3)]
    for t in clients:
        t.start()
    waiting = lambda: _gauge(node.url, "edgeinfer:num_requests_waiting", "llama") or 0.0  # noqa: E731
    _until(lambda: waiting() >= 1, 60, lambda: f"waiting gauge {waiting()}")
    assert _gauge(node.url, "edgeinfer:num_requests_running", "llama") == 1.0
    status = httpx.get(node.url + "/node/status", timeout=10).json()
    assert status["queue_depth"] >= 1 and status["running"] >= 1

    busy = {"model": "llama", "prompt": "Hi", "max_tokens": 2, "options": {"rejectIfBusy": True}}
    answer = httpx.post(node.url + "/v1/completions", json=busy, timeout=30)
    assert answer.status_code == 429, answer.text
    assert "rejectIfBusy" in answer.json()["error"]["message"]
    ready = httpx.get(node.url + "/ready", timeout=10).json()
    assert ready["unhealthy"] == {}


def test_upstream_prompt_tokens_are_counted_by_the_models_tokenizer(
    llama_server, default_gguf, node_factory, make_tenant
) -> None:
    """Digits and spaces are ~2 characters a token, so the length estimate (4 a token) admits a prompt
    that the tenant's tokens/min can never hold; counted by the model's tokenizer it is refused (400)."""
    tenants = [make_tenant("t", "key-t", tokens_per_minute=250)]
    prompt = " ".join(str(i % 10) for i in range(300))
    body = {"model": "llama", "prompt": prompt, "max_tokens": 1}
    auth = {"authorization": "Bearer key-t"}
    guessed = node_factory({}, upstreams={"llama": llama_server}, tenants=tenants)
    answer = httpx.post(guessed.url + "/v1/completions", json=body, headers=auth, timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["prompt_tokens"] > 250  # what the estimate missed

    counted = node_factory(
        {},
        upstreams={"llama": llama_server},
        upstream_tokenizers={"llama": str(default_gguf)},
        tenants=tenants,
    )
    answer = httpx.post(counted.url + "/v1/completions", json=body, headers=auth, timeout=120)
    assert answer.status_code == 400, answer.text
    assert "tokens" in answer.json()["error"]["message"]


def test_engine_metric_names_parse_into_member_stats() -> None:
    vllm = (
        '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 3.0\n'
        '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="m"} 5.0\n'
        'vllm:num_requests_waiting{model_name="other"} 9.0\n'
        '# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{model_name="m"} 0.5\n'
    )
    stats = parse_metrics(vllm, "m")
    assert stats is not None and (stats.num_running, stats.num_waiting, stats.kv_usage) == (3, 5, 0.5)
    sglang = (
        '# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{model_name="m"} 2\n'
        '# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{model_name="m"} 7\n'
        '# TYPE sglang:token_usage gauge\nsglang:token_usage{model_name="m"} 0.25\n'
    )
    stats = parse_metrics(sglang, "m")
    assert stats is not None and (stats.num_running, stats.num_waiting, stats.kv_usage) == (2, 7, 0.25)
    assert parse_metrics("# TYPE up gauge\nup 1\n", "m") is None
    slots = parse_slots([{"id": 0, "is_processing": True}, {"id": 1, "is_processing": False}])
    assert (slots.num_running, slots.num_waiting, slots.seats) == (1, 0, 2)
