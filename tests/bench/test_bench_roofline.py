"""The roofline arithmetic of bench/roofline.py (the measurements themselves are a benchmark, not a test)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "roofline.py"
_spec = importlib.util.spec_from_file_location("bench_roofline", _PATH)
assert _spec is not None and _spec.loader is not None
roofline = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = roofline  # dataclasses resolve their module through sys.modules
_spec.loader.exec_module(roofline)


def test_gemma3_270m_parameter_counts() -> None:
    shape = roofline.ModelShape()
    assert shape.layer_params == 5_570_560  # q 640x1024, k/v 640x256, o 1024x640, 3 MLP 640x2048
    assert shape.matmul_params == 18 * 5_570_560 + 262_144 * 640  # 268 M with the tied vocabulary projection


def test_sliding_window_caps_kv_reads_on_local_layers() -> None:
    shape = roofline.ModelShape()
    assert shape.kv_tokens_read(100) == 18 * 100
    assert shape.kv_tokens_read(1000) == 3 * 1000 + 15 * 512  # 3 global layers of 18
    assert shape.kv_bytes_per_seq(100) == 18 * 100 * 2 * 256 * 2  # K and V, one KV head of 256, bf16


def test_ceiling_is_bandwidth_bound_at_batch_one_and_compute_bound_at_large_batch() -> None:
    shape = roofline.ModelShape()
    weight_bytes = shape.matmul_params * 2.0
    kv = shape.kv_bytes_per_seq(64)
    one = roofline.decode_ceiling(shape, 1, 64, 2.0, bandwidth_gbs=10.0, gflops=1e9)
    assert one == pytest.approx(10e9 / (weight_bytes + kv))
    big = roofline.decode_ceiling(shape, 4096, 64, 2.0, bandwidth_gbs=1e9, gflops=100.0)
    assert big == pytest.approx(100e9 / shape.flops_per_token(64))
