"""A decode step of a dense or MoE model through our one-call C++ step (kernels/dense_step.cpp).

With the decode ops on (model/decode_ops.py), a decode step already runs each small norm, rotation, product
and attention as one kernel call; what is left is calling many of them a layer from Python, through the
modules. Here the embedding, the rope tables and the final norm stay in Python and every layer runs
inside one C++ call, which releases the GIL for the whole of it (step times: docs/benchmarks.md). Steps
that prefill keep the eager path.

It runs what the eager path runs (our kernels where it takes them, the same ATen ops where it does not),
in the same order, so its hidden states equal the eager path's bit for bit
(tests/quant/test_dense_step.py). A sparse MoE layer runs the same C++ block its eager forward calls
(SparseMoeBlock.kernel_block, moe_block.cpp), and latent attention (MLA) the same `mla_decode` its eager
absorbed decode calls. GQA layers attend over a bf16 cache or an int8 / float8 one, whose new K/V the
step quantizes as the eager path's storage does (kernels/kv_write.cpp). Models or layers it does not
cover (softcapped attention, MLA's expand mode or a quantized latent cache, int8 or fp8 weights, an int4
KV cache) keep the eager path: `fused_decode` returns None for them.

A step with LoRA adapter rows runs here too: the step's plan (engine/lora/step.py) goes to the C++ step,
which adds each targeted module's deltas by the same `lora_add` call as the eager path's hooks, so an
adapter's hidden states are the eager path's bit for bit as well.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.mla import AbsorbLatentAttention
from edgeinfer.engine.attention.storage import KVCacheStorage
from edgeinfer.engine.kernels import ops
from edgeinfer.engine.kernels.limits import KernelLimits
from edgeinfer.engine.model.dense import DecoderLayer, DenseCausalLM
from edgeinfer.engine.model.kernel_forms import Form, linear_form, prefixed
from edgeinfer.engine.model.layers.attention import SelfAttention
from edgeinfer.engine.model.layers.mlp import ACT_CODES
from edgeinfer.engine.model.layers.norm import RMSNorm
from edgeinfer.engine.model.layers.rotary import RotaryEmbedding
from edgeinfer.engine.model.mla import MultiLatentAttention
from edgeinfer.engine.model.moe import SparseMoeBlock
from edgeinfer.engine.model.moe_lm import MoeCausalLM, MoeDecoderLayer

if TYPE_CHECKING:
    from edgeinfer.engine.lora.step import StepPlan


class FusedDecode:
    """`model(ids, positions, backend)` for a step in which every sequence decodes one token."""

    def __init__(self, model: DenseCausalLM | MoeCausalLM, step: Any, ropes: list[RotaryEmbedding]) -> None:
        self.model = model
        self.step = step
        self.ropes = ropes
        self._lora: StepPlan | None = None  # the adapters' plan the C++ step holds

    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        stop: torch.Tensor | None = None,
        lora: StepPlan | None = None,
    ) -> torch.Tensor | None:
        """The step's hidden states, with the deltas of the adapters in `lora` (None: no adapter rows);
        None where `stop` (an int32 flag another thread may set) was set before one of the layers, which
        ends the step there (runner/interrupt.py)."""
        self._hold_lora(lora)
        model = self.model
        x = model.embed(ids) if isinstance(model, DenseCausalLM) else model.model.embed_tokens(ids)
        tables = [rope.tables(positions, x.dtype) for rope in self.ropes]
        cos, sin = [c for c, _ in tables], [s for _, s in tables]
        # every KV group's slots [G, T] and tables [G, T, n]: each layer reads its own group's
        slots = meta.slot_mapping.view(-1, meta.slot_mapping.shape[-1])
        blocks = meta.block_tables.view(-1, *meta.block_tables.shape[-2:])[:, : meta.num_seqs]
        x = self.step.run(x, cos, sin, slots, blocks, meta.decode_context_lens(x.device), stop)
        return None if x.shape[0] == 0 else self.model.model.norm(x)

    def _hold_lora(self, plan: StepPlan | None) -> None:
        """Hand the C++ step the adapters' plan where it changed: a decode step's is usually its last
        step's, the same object (lora/apply.py keeps it), and then nothing crosses to C++."""
        if plan is self._lora:
            return
        sites = list(plan.modules.items()) if plan is not None else []
        self.step.set_lora(
            plan.rows if plan is not None else torch.empty(0, dtype=torch.long),
            [layer for (layer, _), _ in sites],
            [module for (_, module), _ in sites],
            [site.a for _, site in sites],
            [site.b for _, site in sites],
            [site.plan for _, site in sites],
        )
        self._lora = plan


def fused_decode(model: nn.Module, storage: KVCacheStorage, limits: KernelLimits) -> FusedDecode | None:
    """The fused step for `model` over `storage` (within the eager path's kernel `limits`), or None where
    some layer needs the eager path. Call after the decode ops are on (`use_decode_ops`): it takes only
    layers that would run on them."""
    if not storage.kernel_readable or not _norm_ok(model.model.norm):
        return None
    if isinstance(model, DenseCausalLM):
        if model.args.attn_softcap is not None:
            return None
    elif not isinstance(model, MoeCausalLM):
        return None
    ropes: list[RotaryEmbedding] = []
    layers = []
    for i, layer in enumerate(model.model.layers):
        described = _describe(layer, storage, i, ropes)
        if described is None:
            return None
        layers.append(described)
    # where the eager path hands products to torch's GEMM and small ops to torch's kernels
    step = ops.dense_decode_step(limits.bf16_gemv_rows, limits.decode_op_elements)
    for layer, (tensors, numbers) in zip(model.model.layers, layers, strict=True):
        if isinstance(layer.mlp, SparseMoeBlock):
            step.add_moe_layer(tensors, numbers, layer.mlp.kernel_block)
        else:
            step.add_layer(tensors, numbers)
    return FusedDecode(model, step, ropes)


def _describe(
    layer: DecoderLayer | MoeDecoderLayer, storage: KVCacheStorage, index: int, ropes: list[RotaryEmbedding]
) -> Form | None:
    """One layer as `DenseDecodeStep.add_layer` (or `add_moe_layer`, with its MoE block) takes it, or None
    if any part is outside the kernels."""
    attn, mlp = layer.self_attn, layer.mlp
    if isinstance(attn, MultiLatentAttention):
        attention = _latent(attn, storage, index)
    else:
        attention = _gqa(attn, storage, index)
    norms = {"input_norm": layer.input_layernorm, "post_attention_norm": layer.post_attention_layernorm}
    if getattr(layer, "sandwich", False):
        norms |= {
            "pre_feedforward_norm": layer.pre_feedforward_layernorm,
            "post_feedforward_norm": layer.post_feedforward_layernorm,
        }
    linears: dict[str, nn.Module] = {}
    if isinstance(mlp, SparseMoeBlock):
        act = ACT_CODES.get(mlp.spec.act) if mlp.kernel_block is not None else None
    else:
        linears = {"gate_up": mlp.gate_up_proj, "down": mlp.down_proj}
        act = mlp.act_code
    rope = attn.rope
    if attention is None or act is None or not rope.kernel_elements:
        return None
    parts = _parts(norms, linears)
    if parts is None:
        return None
    if rope not in ropes:
        ropes.append(rope)
    more = {"rope": ropes.index(rope), "rotary_dim": rope.rotary_dim, "interleaved": float(rope.interleaved)}
    return attention[0] | parts[0], attention[1] | parts[1] | more | {"act": act}


def _gqa(attn: SelfAttention, storage: KVCacheStorage, index: int) -> Form | None:
    shape = attn.shape
    if shape.softcap is not None:
        return None
    norms = {"q_norm": attn.q_norm, "k_norm": attn.k_norm} if shape.qk_norm else {}
    parts = _parts(norms, {"qkv": attn.qkv_proj, "o": attn.o_proj})
    if parts is None:
        return None
    k_pool, v_pool, k_scales, v_scales = storage.kernel_pools(index)
    tensors = {"k_pool": k_pool, "v_pool": v_pool}
    if k_scales is not None and v_scales is not None:  # an int8 / float8 cache
        tensors |= {"k_scales": k_scales, "v_scales": v_scales}
    numbers = {
        "heads": shape.num_heads,
        "kv_heads": shape.num_kv_heads,
        "head_dim": shape.head_dim,
        "scale": attn.scale,
        "window": shape.window or 0,
        "group": storage.group_of(index),
    }
    return parts[0] | tensors, parts[1] | numbers


def _latent(attn: MultiLatentAttention, storage: KVCacheStorage, index: int) -> Form | None:
    """MLA in its absorbed decode over a bf16 cache, where the eager path takes our `mla_decode` too."""
    s, kv_b = attn.shape, attn.kv_b_proj.weight
    absorbed = isinstance(attn.impl, AbsorbLatentAttention)
    if not absorbed or kv_b.dtype != torch.bfloat16 or not storage.lossless:
        return None
    if s.q_lora_rank is None:
        norms, linears = {}, {"q": attn.q_proj}
    else:
        norms, linears = {"q_a_norm": attn.q_a_layernorm}, {"q_a": attn.q_a_proj, "q_b": attn.q_b_proj}
    norms["kv_a_norm"] = attn.kv_a_layernorm
    parts = _parts(norms, linears | {"kv_a": attn.kv_a_proj_with_mqa, "o": attn.o_proj})
    if parts is None:
        return None
    tensors = {"kv_b": kv_b.detach(), "latent_pool": storage.k[index].data}
    numbers = {
        "mla": 1.0,
        "heads": s.num_heads,
        "nope": s.nope_dim,
        "v_dim": s.v_dim,
        "rank": s.kv_lora_rank,
        "scale": s.scale,
    }
    return parts[0] | tensors, parts[1] | numbers


def _parts(norms: dict[str, nn.Module], linears: dict[str, nn.Module]) -> Form | None:
    """Norms and linears by name, or None where one of them is outside the kernels."""
    tensors: dict[str, torch.Tensor] = {}
    numbers: dict[str, float] = {}
    for name, norm in norms.items():
        if not _norm_ok(norm):
            return None
        tensors[name] = norm.kernel_weight()
        numbers |= {f"{name}.eps": norm.eps, f"{name}.round_first": float(not norm.unit_offset)}
    for name, linear in linears.items():
        described = linear_form(linear)
        if described is None:
            return None
        more_tensors, more_numbers = prefixed(name, described)
        tensors |= more_tensors
        numbers |= more_numbers
    return tensors, numbers


def _norm_ok(norm: nn.Module) -> bool:
    return isinstance(norm, RMSNorm) and norm.takes_kernel_weight() and norm.kernel_elements > 0
