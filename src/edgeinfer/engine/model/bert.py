"""BERT encoders (MiniLM, BGE, E5) over a packed batch: no padding, no KV cache.

A batch is one `[T, hidden]` tensor of every sequence's tokens back to back, sequences sorted by length
so that sequences of equal length sit next to each other. The linear layers see only real tokens;
attention runs in one call of our CPU kernel over the whole pass (`packed`, kernels/
encoder_attention.cpp), per group of equal-length sequences (`grouped`, one SDPA call per distinct
length), or over chunks of the batch with a block-diagonal mask (`masked`, kept to compare: its cost
grows with the square of the chunk, so chunks hold at most MASK_CHUNK_TOKENS tokens). `auto` is packed
where the kernel has a vector variant for the CPU and head dim, else grouped.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from edgeinfer.engine import kernels
from edgeinfer.engine.kernels import ops
from edgeinfer.engine.model.hf_config import ConfigError

ATTENTION_MODES = ("auto", "packed", "grouped", "masked")
# Head dims the packed kernel's AVX-512 variant takes (encoder_attention.cpp pick_avx512); others run as
# plain loops, slower than SDPA.
PACKED_HEAD_DIMS = (16, 32, 64, 128)
# The packed kernel's vector variant needs AVX-512: that level or any above it (kernels.ISA_LEVELS).
_VECTOR_ISAS = kernels.ISA_LEVELS[kernels.ISA_LEVELS.index("avx512") :]
# The scores of a masked chunk are [heads, n, n] fp32: 2048 tokens x 12 heads is 200 MB; a whole batch of
# 18k tokens would be 16 GB.
MASK_CHUNK_TOKENS = 2048
_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}
# Checkpoint tensors the encoder does not use: BERT's pooler (sentence-transformers pools itself),
# the position-id buffer, masked-LM heads.
_UNUSED = ("pooler.", "embeddings.position_ids", "cls.")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BertArgs:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    max_pos: int
    type_vocab_size: int
    layer_norm_eps: float
    gelu_approximate: str

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> BertArgs:
        if cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(
                f"BERT position_embedding_type {cfg['position_embedding_type']!r} (absolute only)"
            )
        act = cfg.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ConfigError(f"BERT hidden_act {act!r} unsupported ({', '.join(_ACTIVATIONS)})")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=cfg["num_attention_heads"],
            intermediate_size=cfg["intermediate_size"],
            max_pos=cfg.get("max_position_embeddings", 512),
            type_vocab_size=cfg.get("type_vocab_size", 2),
            layer_norm_eps=cfg.get("layer_norm_eps", 1e-12),
            gelu_approximate=_ACTIVATIONS[act],
        )


@dataclass(frozen=True)
class PackedBatch:
    """Token ids of sequences sorted by length (non-decreasing), back to back, then optionally one
    padding sequence (token 0) that rounds the pass up to a row multiple; `lengths` and `groups` include
    it, `sequences` and `tokens` count the real ones. `groups` lists (first token, number of sequences,
    length) per run of equal lengths."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, restarting at 0 for every sequence
    lengths: tuple[int, ...]
    groups: tuple[tuple[int, int, int], ...]
    cu_seqlens: torch.Tensor  # [n + 1] int64 on the CPU: sequence i is tokens [cu[i], cu[i + 1])
    sequences: int
    tokens: int

    @classmethod
    def build(
        cls, sorted_ids: Sequence[Sequence[int]], device: torch.device, row_multiple: int = 1
    ) -> PackedBatch:
        lengths = [len(ids) for ids in sorted_ids]
        if any(b < a for a, b in itertools.pairwise(lengths)):
            raise ValueError("PackedBatch.build needs sequences sorted by length")
        flat = [t for ids in sorted_ids for t in ids]
        tokens = len(flat)
        if pad := -tokens % row_multiple:
            lengths.append(pad)
            flat += [0] * pad
        positions = [p for n in lengths for p in range(n)]
        groups, start = [], 0
        for length, run in itertools.groupby(lengths):
            n = len(list(run))
            groups.append((start, n, length))
            start += n * length
        as_long = dict(dtype=torch.long, device=device)
        cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long)
        return cls(
            torch.tensor(flat, **as_long),
            torch.tensor(positions, **as_long),
            tuple(lengths),
            tuple(groups),
            cu_seqlens,
            len(sorted_ids),
            tokens,
        )


# Passes on blocked weights are padded to a multiple of this many rows: oneDNN builds (JIT-compiles) a
# primitive per input shape for them, a noticeable cost each, so a pass of a new token count would pay it on
# every linear. Rounded up, at most max_pass_tokens / 32 shapes per layer are ever built, then reused.
BLOCKED_ROW_MULTIPLE = 32


class Linear(nn.Linear):
    """`nn.Linear` that can also hold its weight in oneDNN's blocked layout (CPU): reordered once at load
    instead of inside every call, with the bias and a GELU fused into the matmul: a pass no longer
    reorders the weight each time, and the bias and activation no longer read the output again."""

    blocked: torch.Tensor | None = None

    def block(self, rows: int) -> None:
        """Make the blocked copy, laid out for inputs of about `rows` rows (oneDNN's hint)."""
        self.blocked = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), rows)

    def forward(self, x: torch.Tensor, gelu: str | None = None) -> torch.Tensor:
        """x W^T + b, then GELU (`none`: erf, `tanh`: its approximation) where `gelu` names one."""
        if self.blocked is not None:
            attr, algorithm = ("none", "") if gelu is None else ("gelu", gelu)
            return torch.ops.mkldnn._linear_pointwise(x, self.blocked, self.bias, attr, [], algorithm)
        y = F.linear(x, self.weight, self.bias)
        return y if gelu is None else F.gelu(y, approximate=gelu)


class BertLayer(nn.Module):
    def __init__(self, a: BertArgs, attention: str) -> None:
        super().__init__()
        self.attention = attention
        self.num_heads = a.num_heads
        self.head_dim = a.hidden_size // a.num_heads
        self.qkv = Linear(a.hidden_size, 3 * a.hidden_size)
        self.attn_out = Linear(a.hidden_size, a.hidden_size)
        self.attn_norm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.up = Linear(a.hidden_size, a.intermediate_size)
        self.down = Linear(a.intermediate_size, a.hidden_size)
        self.out_norm = nn.LayerNorm(a.hidden_size, eps=a.layer_norm_eps)
        self.gelu_approximate = a.gelu_approximate

    def forward(self, x: torch.Tensor, batch: PackedBatch, masks: list[MaskedChunk] | None) -> torch.Tensor:
        qkv = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim)
        if self.attention == "packed":
            attn = ops.packed_attention(qkv, batch.cu_seqlens, self.head_dim**-0.5)
        else:
            q, k, v = qkv.unbind(1)
            attn = (
                _grouped_attention(q, k, v, batch.groups)
                if masks is None
                else _masked_attention(q, k, v, masks)
            )
        # Post-norm, as BERT: normalise after each residual add.
        x = self.attn_norm(x + self.attn_out(attn.reshape(x.shape)))
        return self.out_norm(x + self.down(self.up(x, self.gelu_approximate)))

    def linears(self) -> tuple[Linear, ...]:
        return self.qkv, self.attn_out, self.up, self.down


def _grouped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: Iterable[tuple[int, int, int]]
) -> torch.Tensor:
    """One SDPA call per run of equal-length sequences: [n, heads, len, dim] views, no padding."""
    out = torch.empty_like(q)
    for start, n, length in groups:
        end = start + n * length
        qg, kg, vg = (t[start:end].view(n, length, *t.shape[1:]).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qg, kg, vg)
        out[start:end] = o.transpose(1, 2).reshape(end - start, *q.shape[1:])
    return out


MaskedChunk = tuple[int, int, torch.Tensor]  # first token, end token, [n, n] bool mask


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunks: list[MaskedChunk]
) -> torch.Tensor:
    out = torch.empty_like(q)
    for start, end, mask in chunks:
        qc, kc, vc = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(qc, kc, vc, attn_mask=mask).transpose(0, 1)
    return out


def block_diagonal_chunks(lengths: Sequence[int], device: torch.device) -> list[MaskedChunk]:
    """Consecutive sequences in chunks of at most MASK_CHUNK_TOKENS tokens (a longer sequence alone),
    each with a [n, n] mask where a token attends to the tokens of its own sequence only."""
    chunks: list[MaskedChunk] = []
    start, members = 0, []
    for n in [*lengths, None]:
        if members and (n is None or sum(members) + n > MASK_CHUNK_TOKENS):
            seq = torch.repeat_interleave(
                torch.arange(len(members), device=device), torch.tensor(members, device=device)
            )
            end = start + sum(members)
            chunks.append((start, end, seq[:, None] == seq[None, :]))
            start, members = end, []
        if n is not None:
            members.append(n)
    return chunks


def choose_attention(mode: str, device: torch.device, head_dim: int) -> str:
    """The attention a mode means here. `auto`: `packed` on a CPU where our kernel loads with its
    AVX-512 variant allowed and the head dim is one it vectorises, else `grouped`. `packed` asked for
    by name needs only the kernel to load (on the CPU); any head dim, any instruction set."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"attention {mode!r} (one of {', '.join(ATTENTION_MODES)})")
    if mode not in ("auto", "packed"):
        return mode
    loaded = device.type == "cpu" and _kernels_load()
    if mode == "packed":
        if not loaded:
            raise ValueError("attention 'packed' needs our CPU kernels on the CPU (see the log for why not)")
        return mode
    vectorised = loaded and head_dim in PACKED_HEAD_DIMS and ops.isa() in _VECTOR_ISAS
    return "packed" if vectorised else "grouped"


def _kernels_load() -> bool:
    try:
        kernels.load()
        return True
    except kernels.KernelBuildError as e:
        log.warning("packed encoder attention unavailable: %s", e)
        return False


class BertEncoder(nn.Module):
    """`BertModel` without its pooler: packed token ids in, last hidden states `[T, hidden]` out."""

    def __init__(self, args: BertArgs, attention: str = "grouped") -> None:
        super().__init__()
        if attention not in ATTENTION_MODES[1:]:
            raise ValueError(f"attention {attention!r} (one of {', '.join(ATTENTION_MODES[1:])})")
        self.args = args
        self.attention = attention
        self.word_embeddings = nn.Embedding(args.vocab_size, args.hidden_size)
        self.position_embeddings = nn.Embedding(args.max_pos, args.hidden_size)
        self.token_type_embeddings = nn.Embedding(args.type_vocab_size, args.hidden_size)
        self.embed_norm = nn.LayerNorm(args.hidden_size, eps=args.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(args, attention) for _ in range(args.num_layers))

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        # Single-segment inputs: every token has token type 0.
        x = self.word_embeddings(batch.input_ids) + self.position_embeddings(batch.positions)
        x = self.embed_norm(x + self.token_type_embeddings.weight[0])
        masks = block_diagonal_chunks(batch.lengths, x.device) if self.attention == "masked" else None
        for layer in self.layers:
            x = layer(x, batch, masks)
        return x

    def block_weights(self, rows: int) -> int:
        """Every linear layer's weight in oneDNN's blocked layout too (after loading and any dtype or
        device move; a CPU with torch's oneDNN); returns the bytes the copies hold."""
        linears = [lin for layer in self.layers for lin in layer.linears()]
        for lin in linears:
            lin.block(rows)
        return sum(lin.weight.numel() * lin.weight.element_size() for lin in linears)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Fill from HF `BertModel` names (with or without a `bert.` prefix); q, k, v are fused."""
        params = dict(self.named_parameters())
        pending: dict[str, dict[str, torch.Tensor]] = {}
        loaded: set[str] = set()
        for name, tensor in tensors:
            name = name.removeprefix("bert.")
            if name.startswith(_UNUSED):
                continue
            target, part = _our_name(name)
            if part is None:
                _copy(params, target, tensor)
                loaded.add(target)
                continue
            parts = pending.setdefault(target, {})
            parts[part] = tensor
            if len(parts) == 3:
                _copy(params, target, torch.cat([parts["query"], parts["key"], parts["value"]]))
                loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {', '.join(missing[:5])}")


_LAYER_NAMES = {
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up",
    "output.dense": "down",
    "output.LayerNorm": "out_norm",
}


def _our_name(hf: str) -> tuple[str, str | None]:
    """Our parameter name for an HF one, and which of query/key/value it is (None: not a q/k/v part)."""
    if hf.startswith("embeddings."):
        return hf.removeprefix("embeddings.").replace("LayerNorm", "embed_norm"), None
    if not hf.startswith("encoder.layer."):
        raise ValueError(f"unexpected BERT tensor {hf!r}")
    index, _, rest = hf.removeprefix("encoder.layer.").partition(".")
    module, _, kind = rest.rpartition(".")
    if module.startswith("attention.self."):
        return f"layers.{index}.qkv.{kind}", module.removeprefix("attention.self.")
    if module not in _LAYER_NAMES:
        raise ValueError(f"unexpected BERT tensor {hf!r}")
    return f"layers.{index}.{_LAYER_NAMES[module]}.{kind}", None


def _copy(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> None:
    if name not in params:
        raise ValueError(f"unexpected BERT tensor for {name!r}")
    if params[name].shape != tensor.shape:
        raise ValueError(
            f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(params[name].shape)}"
        )
    with torch.no_grad():
        params[name].copy_(tensor)
