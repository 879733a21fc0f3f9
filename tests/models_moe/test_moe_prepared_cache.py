"""Quantized MoE models in the prepared-form cache: a second load with the same settings restores the
quantized expert stacks from the entry the first load wrote (no quantization runs), in the layout they were
saved in, and computes exactly the first load's logits."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
import torch

from edgeinfer.engine.attention.oneshot import prefill_hidden
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.loading import load_model
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.model.moe import FusedExperts
from edgeinfer.engine.quant import QuantizedExperts
from edgeinfer.engine.quant.layers import PreparedModule

CPU = torch.device("cpu")
HIT = "loaded the prepared model"
QUANTIZED = re.compile(r"quantized \d+ modules")  # quant.apply's line for every quantization pass
IDS = [1, 17, 45, 200, 9, 33, 120, 7]


def _load(path: str, cache_dir: Path, spec: str, cpu_gemv: bool | None) -> torch.nn.Module:
    """Uncalibrated: calibration only changes the values, and costs seconds per load."""
    config = EngineConfig(
        model=path,
        quantization=spec,
        cache_dir=str(cache_dir),
        calibrate_quantization=False,
        cpu_gemv=cpu_gemv,
    )
    return load_model(open_checkpoint(path), torch.bfloat16, CPU, config)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model.compute_logits(prefill_hidden(model, IDS, torch.bfloat16, CPU))


def _stacks(model: torch.nn.Module) -> list[tuple[str, str, dict[str, tuple]]]:
    """Every expert stack's name, kernel and runtime tensors' dtypes and shapes."""
    return [
        (name, m.kernel, {n: (t.dtype, tuple(t.shape)) for n, t in m.prepared().tensors.items()})
        for name, m in model.named_modules()
        if isinstance(m, QuantizedExperts)
    ]


def _kernels(model: torch.nn.Module) -> list[str]:
    return [m.kernel for m in model.modules() if isinstance(m, PreparedModule)]


def _load_twice(path: str, cache_dir: Path, spec: str, cpu_gemv: bool | None, caplog) -> tuple:
    first = _load(path, cache_dir, spec, cpu_gemv)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edgeinfer.engine"):
        second = _load(path, cache_dir, spec, cpu_gemv)
    return first, second, caplog.text


@pytest.mark.parametrize("spec", ["int8", "int4"])
@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "deepseek_v3", "kimi_k2"])
def test_second_load_restores_the_quantized_experts(family, spec, moe_models, tmp_path, caplog):
    first, second, log = _load_twice(moe_models[family], tmp_path / "cache", spec, None, caplog)
    assert HIT in log and "rejected" not in log
    assert not QUANTIZED.search(log)  # nothing was quantized again
    experts = [m for m in second.modules() if isinstance(m, FusedExperts)]
    assert experts and all(isinstance(e.gate_up_proj, QuantizedExperts) for e in experts)
    assert _stacks(second) == _stacks(first)
    assert _kernels(second) == _kernels(first)
    want, got = _logits(first), _logits(second)
    assert torch.equal(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("spec", ["int8", "int4", "fp8"])
def test_torch_kernel_layouts_are_restored_too(spec, moe_models, tmp_path, caplog):
    """Without our kernels the stacks keep the methods' own layouts (int4's torch packing, int8's codes,
    fp8); those are cached as they are."""
    first, second, log = _load_twice(moe_models["glm4_moe"], tmp_path / "cache", spec, False, caplog)
    assert HIT in log and not QUANTIZED.search(log)
    assert _stacks(second) == _stacks(first)
    assert torch.equal(_logits(second), _logits(first))
