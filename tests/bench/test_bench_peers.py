"""bench/peers.py's llama.cpp build switches: named from the CPU's flags, never GGML_NATIVE, AMX off."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[2] / "bench" / "peers.py"
_spec = importlib.util.spec_from_file_location("bench_peers", _PATH)
assert _spec is not None and _spec.loader is not None
peers = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = peers
_spec.loader.exec_module(peers)

AVX2 = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
AVX512 = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})
AVX512_EXTRA = frozenset({"avx512_vbmi", "avx512_vnni", "avx512_bf16"})
SAPPHIRE_RAPIDS = AVX2 | AVX512 | AVX512_EXTRA | {"avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}


def _switches(flags: frozenset[str]) -> dict[str, str]:
    return dict(f.removeprefix("-D").split("=") for f in peers.cpu_cmake_flags(flags))


def test_an_amx_xeon_gets_avx512_vnni_bf16_and_no_amx() -> None:
    s = _switches(SAPPHIRE_RAPIDS)
    assert s["GGML_AVX512"] == s["GGML_AVX512_VNNI"] == s["GGML_AVX512_BF16"] == "ON"
    assert s["GGML_AMX_TILE"] == s["GGML_AMX_INT8"] == s["GGML_AMX_BF16"] == "OFF"
    assert "-DGGML_NATIVE=OFF" in peers.CMAKE_FLAGS and "-DGGML_NATIVE=ON" not in peers.CMAKE_FLAGS


def test_an_avx2_cpu_gets_no_avx512() -> None:
    s = _switches(AVX2)
    assert s["GGML_AVX2"] == s["GGML_FMA"] == "ON"
    assert s["GGML_AVX512"] == s["GGML_AVX512_VNNI"] == s["GGML_AVX512_BF16"] == "OFF"


def test_avx512_needs_all_four_of_its_subsets() -> None:
    assert _switches(SAPPHIRE_RAPIDS - {"avx512dq"})["GGML_AVX512"] == "OFF"
