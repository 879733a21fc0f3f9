"""Where each HF projection an adapter targets lives in our model: our dense layers fuse q/k/v into
`qkv_proj` and gate/up into `gate_up_proj`, so a target is a module and a slice of its output."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from edgeinfer.engine.lora.config import AdapterError
from edgeinfer.engine.model.dense import DenseCausalLM


@dataclass(frozen=True)
class Target:
    module: str  # our module in each layer: "qkv", "o", "gate_up" or "down"
    lo: int  # the projection's output columns in it: [lo, hi)
    hi: int
    in_features: int


@dataclass(frozen=True)
class BaseTargets:
    num_layers: int
    projections: dict[str, Target]  # by HF name (q_proj, ...)

    def modules(self, model: nn.Module) -> dict[tuple[int, str], nn.Module]:
        """(layer, our module name) -> the linear module whose output the deltas are added to."""
        found = {}
        for i, layer in enumerate(model.model.layers):
            found[(i, "qkv")] = layer.self_attn.qkv_proj
            found[(i, "o")] = layer.self_attn.o_proj
            found[(i, "gate_up")] = layer.mlp.gate_up_proj
            found[(i, "down")] = layer.mlp.down_proj
        return found


def base_targets(model: nn.Module) -> BaseTargets:
    """The projections of a dense model; adapters on other families (MoE, MLA) are refused."""
    if not isinstance(model, DenseCausalLM):
        name = type(model).__name__
        raise AdapterError(f"LoRA adapters need a dense model (Llama, Qwen3, Gemma 3), not {name}")
    a = model.args
    q, kv, inter, h = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim, a.intermediate, a.hidden
    projections = {
        "q_proj": Target("qkv", 0, q, h),
        "k_proj": Target("qkv", q, q + kv, h),
        "v_proj": Target("qkv", q + kv, q + 2 * kv, h),
        "o_proj": Target("o", 0, h, q),
        "gate_proj": Target("gate_up", 0, inter, h),
        "up_proj": Target("gate_up", inter, 2 * inter, h),
        "down_proj": Target("down", 0, h, inter),
    }
    return BaseTargets(a.num_layers, projections)
