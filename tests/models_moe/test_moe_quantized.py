"""`--quantization` reaches the routed experts: every expert stack becomes a quantized one, and the
quantized MoE model stays close to the float one (one prefill, KL of the next-token distributions)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from helpers.kernels import require_gemv_kernels

from edgeinfer.engine import kernels
from edgeinfer.engine.attention.oneshot import prefill_hidden
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.loading import load_model, parse_quantization
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.model.moe import FusedExperts
from edgeinfer.engine.model.registry import build_model
from edgeinfer.engine.quant import QuantizedExperts
from edgeinfer.engine.quant.calibrate import default_calibration_text

# mean KL bound in nats over 24 positions of a random tiny model (measured well below: int8 ~1e-4, int4 ~1e-2)
BOUNDS = {"int8": 0.01, "int4:32": 0.1}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize(("spec", "gptq"), [("int8", False), ("int4:32", False), ("int4:32", True)])
def test_experts_are_quantized_and_close(family, spec, gptq, moe_models, tmp_path):
    """With GPTQ, the attention (MLA too) and router linears are GPTQ-rounded, the experts rounded."""
    text = None
    if gptq:
        text = tmp_path / "calibration.txt"
        text.write_text(default_calibration_text())
    ckpt = open_checkpoint(moe_models[family])
    cpu = torch.device("cpu")
    ids = torch.randint(3, 200, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    ref = load_model(ckpt, torch.float32, cpu)
    want = torch.log_softmax(ref.compute_logits(prefill_hidden(ref, ids, torch.float32, cpu)), -1)
    cfg = EngineConfig(
        model=moe_models[family], quantization=spec, gptq_calibration=None if text is None else str(text)
    )
    model = load_model(ckpt, torch.float32, cpu, cfg)
    experts = [m for m in model.modules() if isinstance(m, FusedExperts)]
    assert experts and all(
        isinstance(e.gate_up_proj, QuantizedExperts) and isinstance(e.down_proj, QuantizedExperts)
        for e in experts
    )
    got = torch.log_softmax(model.compute_logits(prefill_hidden(model, ids, torch.float32, cpu)), -1)
    kl = (want.exp() * (want - got)).sum(-1).mean().item()
    assert 0 < kl < BOUNDS[spec]


@pytest.mark.parametrize("spec", ["int8", "int4:32"])
def test_experts_run_on_our_cpu_kernels(spec, moe_models):
    """`cpu_gemv` moves the expert stacks onto our kernels too: int8 bit for bit, int4 as W4A8."""
    require_gemv_kernels()
    ckpt = open_checkpoint(moe_models["qwen3_moe"])
    cpu = torch.device("cpu")
    ids = torch.randint(3, 200, (3,), generator=torch.Generator().manual_seed(1)).tolist()
    configs = (EngineConfig(model=str(ckpt.path), quantization=spec, cpu_gemv=on) for on in (False, True))
    plain, fast = (load_model(ckpt, torch.float32, cpu, cfg) for cfg in configs)
    stacks = [m for m in fast.modules() if isinstance(m, QuantizedExperts)]
    assert stacks and all(m.kernel in kernels.KERNELS for m in stacks)
    want, got = (m.compute_logits(prefill_hidden(m, ids, torch.float32, cpu)) for m in (plain, fast))
    if spec == "int8":
        assert torch.equal(got, want)
    else:
        assert torch.allclose(got, want, atol=0.05 * want.abs().max().item())


@pytest.mark.parametrize("spec", ["int8", "int4:32", "fp8"])
@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_experts_quantized_as_they_load(family, spec, moe_models):
    """A quantized load quantizes each expert stack once its last tensor has arrived: while the checkpoint
    is read, no more than one layer's stacks (gate-up and down, whose experts' tensors interleave) are
    float, and the stacks equal those of quantizing the whole float model afterwards."""
    ckpt = open_checkpoint(moe_models[family])
    method = parse_quantization(spec)
    streamed = build_model(ckpt.config)
    streamed.load_weights(_watching_float_stacks(streamed, ckpt.iter_tensors(None)), expert_method=method)
    after = build_model(ckpt.config)
    after.load_weights(ckpt.iter_tensors(None))
    for m in after.modules():
        if isinstance(m, FusedExperts):
            m.quantize_weights(method)
    want, got = _expert_tensors(after), _expert_tensors(streamed)
    assert want and sorted(got) == sorted(want)
    assert all(torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)) for n, t in want.items())
    assert not [n for n, p in streamed.named_parameters() if ".experts." in n]


def _watching_float_stacks(model: torch.nn.Module, tensors: Iterator[tuple[str, torch.Tensor]]) -> Iterator:
    """`tensors`, checking before each one that at most two expert stacks are float and partly read."""
    started: set[str] = set()
    for name, tensor in tensors:
        floats = [
            f"{owner}.{leaf}"
            for owner, m in model.named_modules()
            if isinstance(m, FusedExperts)
            for leaf in ("gate_up_proj", "down_proj")
            if isinstance(getattr(m, leaf), torch.nn.Parameter)
        ]
        assert len(started.intersection(floats)) <= 2, sorted(started.intersection(floats))
        if ".experts." in name:
            owner = name.split(".experts.")[0] + ".experts"
            started.update({f"{owner}.gate_up_proj", f"{owner}.down_proj"})
        yield name, tensor


def _expert_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {
        f"{n}.{t}": v.contiguous().reshape(-1)
        for n, m in model.named_modules()
        if isinstance(m, QuantizedExperts)
        for t, v in m.prepared().tensors.items()
    }
