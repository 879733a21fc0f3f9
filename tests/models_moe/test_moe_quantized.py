"""`--quantization` reaches the routed experts: every expert stack becomes a quantized one, and the
quantized MoE model stays close to the float one (one prefill, KL of the next-token distributions)."""

from __future__ import annotations

import pytest
import torch
from helpers.kernels import require_gemv_kernels

from edgeinfer.engine.attention.oneshot import prefill_hidden
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.loading import load_model
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.model.moe import FusedExperts
from edgeinfer.engine.quant import QuantizedExperts, kernels
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
