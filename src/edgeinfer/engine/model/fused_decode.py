"""A decode step of a dense model through our one-call C++ step (quant/kernels/dense_step.cpp).

With the decode ops on (kernels.decode), a decode step already runs each small norm, rotation, product
and attention as one kernel call; what is left is calling ~15 of them a layer from Python, through the
modules. Here the embedding, the rope tables and the final norm stay in Python and every layer runs
inside one C++ call, which releases the GIL for the whole of it. Measured on Gemma 3 270M (2 threads, AMD
EPYC, interleaved in one process, medians): one sequence 20.9 → 17.7 ms a step in bf16, 13.0 → 10.3 ms
in int4; 8 sequences 45.3 → 43.2 ms in bf16 (35.8 → 31.2 in int4), 32 sequences 95.1 → 90.8 ms, where
torch's GEMMs take most of the step. Steps that prefill keep the eager path.

It runs what the eager path runs (our kernels where it takes them, the same ATen ops where it does not),
in the same order, so its hidden states equal the eager path's bit for bit
(tests/quant/test_dense_step.py). Models or layers it does not cover (MoE, MLA, softcapped attention,
int8 or fp8 weights, a quantized KV cache) keep the eager path: `fused_dense_decode` returns None for
them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.storage import KVCacheStorage
from edgeinfer.engine.model.dense import DecoderLayer, DenseCausalLM
from edgeinfer.engine.model.layers.kernel_ops import MAX_ELEMENTS
from edgeinfer.engine.model.layers.norm import RMSNorm
from edgeinfer.engine.model.layers.rotary import RotaryEmbedding
from edgeinfer.engine.quant.kernels.bf16 import GEMV_ROWS, GemvLinear
from edgeinfer.engine.quant.layers import QuantLinear


class FusedDenseDecode:
    """`model(ids, positions, backend)` for a step in which every sequence decodes one token."""

    def __init__(self, model: DenseCausalLM, step: Any, ropes: list[RotaryEmbedding]) -> None:
        self.model = model
        self.step = step
        self.ropes = ropes

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.model.embed(ids)
        tables = [rope.tables(positions, x.dtype) for rope in self.ropes]
        cos, sin = [c for c, _ in tables], [s for _, s in tables]
        blocks, ctx = meta.block_tables[: meta.num_seqs], meta.decode_context_lens(x.device)
        x = self.step.run(x, cos, sin, meta.slot_mapping, blocks, ctx)
        return self.model.model.norm(x)


def fused_dense_decode(model: nn.Module, storage: KVCacheStorage) -> FusedDenseDecode | None:
    """The fused step for `model` over `storage`, or None where some layer needs the eager path. Call
    after the decode ops are on (`use_decode_ops`): it takes only layers that would run on them."""
    if not isinstance(model, DenseCausalLM) or not _plain_bf16_cache(storage):
        return None
    if model.args.attn_softcap is not None or not _norm_ok(model.model.norm):
        return None
    ropes: list[RotaryEmbedding] = []
    layers = []
    for i, layer in enumerate(model.model.layers):
        described = _describe(layer, storage, i, ropes)
        if described is None:
            return None
        layers.append(described)
    # where the eager path hands products to torch's GEMM and small ops to torch's kernels
    step = torch.classes.edgeinfer_cpu.DenseDecodeStep(GEMV_ROWS, MAX_ELEMENTS)
    for tensors, numbers in layers:
        step.add_layer(tensors, numbers)
    return FusedDenseDecode(model, step, ropes)


def _plain_bf16_cache(storage: KVCacheStorage) -> bool:
    return (
        storage.lossless
        and storage.dtype == torch.bfloat16
        and all(v is not None and v.data.dtype == torch.bfloat16 for v in storage.v)
    )


def _describe(
    layer: DecoderLayer, storage: KVCacheStorage, index: int, ropes: list[RotaryEmbedding]
) -> tuple[dict[str, torch.Tensor], dict[str, float]] | None:
    """One layer as `DenseDecodeStep.add_layer` takes it, or None if any part is outside the kernels."""
    attn, mlp, shape = layer.self_attn, layer.mlp, layer.self_attn.shape
    rope = attn.rope
    norms = {"input_norm": layer.input_layernorm, "post_attention_norm": layer.post_attention_layernorm}
    if layer.sandwich:
        norms |= {
            "pre_feedforward_norm": layer.pre_feedforward_layernorm,
            "post_feedforward_norm": layer.post_feedforward_layernorm,
        }
    if shape.qk_norm:
        norms |= {"q_norm": attn.q_norm, "k_norm": attn.k_norm}
    linears = {"qkv": attn.qkv_proj, "o": attn.o_proj, "gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
    if not (rope.kernel and mlp.act_code is not None and shape.softcap is None):
        return None
    if not all(_norm_ok(n) for n in norms.values()):
        return None
    tensors: dict[str, torch.Tensor] = {"k_pool": storage.k[index].data, "v_pool": storage.v[index].data}
    numbers: dict[str, float] = {}
    for name, norm in norms.items():
        tensors[name] = norm.kernel_weight()
        numbers |= {f"{name}.eps": norm.eps, f"{name}.round_first": float(not norm.unit_offset)}
    for name, linear in linears.items():
        described = _linear(linear)
        if described is None:
            return None
        tensors |= {f"{name}.{k}": t for k, t in described[0].items()}
        numbers |= {f"{name}.{k}": v for k, v in described[1].items()}
    if rope not in ropes:
        ropes.append(rope)
    numbers |= {
        "heads": shape.num_heads,
        "kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "rope": ropes.index(rope),
        "rotary_dim": rope.rotary_dim,
        "interleaved": float(rope.interleaved),
        "scale": attn.scale,
        "window": shape.window or 0,
        "act": mlp.act_code,
    }
    return tensors, numbers


def _norm_ok(norm: nn.Module) -> bool:
    return isinstance(norm, RMSNorm) and norm.takes_kernel_weight() and norm.kernel


def _linear(linear: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, float]] | None:
    """A linear as `bf16_gemv` or `int4_gemv` multiplies it one row at a time, as its forward would."""
    bias = {"bias": linear.bias} if getattr(linear, "bias", None) is not None else {}
    if isinstance(linear, GemvLinear) and linear.weight.dtype == torch.bfloat16:
        return {"weight": linear.weight.detach()} | bias, {}
    if isinstance(linear, QuantLinear) and linear.kernel == "cpu_w4a8":
        t = linear.prepared().tensors
        names = ("codes", "scales", "zero_terms")
        return {n: t[n] for n in names} | bias, {"group": linear.method.group_size}
    return None
