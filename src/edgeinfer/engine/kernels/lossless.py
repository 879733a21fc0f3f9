"""Lossless resident bf16 weights: a form that keeps every bit of a bf16 matrix in about 70 % of its bytes and
that `lossless_gemv` (lossless_gemv.cpp) multiplies where it lies (docs/lossless-weights.md).

A bf16 value is two bytes: the high one holds the sign and the exponent's top seven bits, the low one the
exponent's last bit and the mantissa. The low byte stays raw. The high bytes of a trained matrix gather on a
few values (its exponents on a few neighbours, either sign), so each gets a 3-bit code: codes 0-6 index the
matrix's table of its seven commonest high bytes, code 7 escapes to the next entry of a list of whole high
bytes. A block of 64 inputs then decodes with a table lookup over 64 bytes and two byte interleaves (no
widening, no bit merging): the kernel looks the codes up with `vpermb`, merges the escapes with `vpexpandb`
and interleaves low and high bytes into two vectors of 32 bf16 values with `vpunpcklbw` / `vpunpckhbw`.
Those interleave within 128-bit lanes, so a block's bytes are stored in the order that makes the two vectors
come out as inputs 0-31 and 32-63 (`LANE_ORDER`).

The codes are stored as three bit-planes (int64) per block, which become a code vector with three mask
instructions; the escapes of a row follow the previous row's, and `offsets` holds where every group of
`GROUP` rows begins, so groups decode independently (one thread a group, or one embedding row). Rows are
padded to whole blocks; the kernels never multiply the padding.

`LosslessLinear` and `LosslessEmbedding` hold the form as buffers (the prepared-form cache stores them as
they are); a tied lm_head and embedding share one form.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from edgeinfer.engine.kernels import ops
from edgeinfer.engine.kernels.bf16 import GemvLinear

BLOCK = 64  # inputs per block of codes (one byte vector; two `vdpbf16ps` chunks)
GROUP = 16  # rows per escape offset (lossless_gemv.cpp kGroup)
ESCAPE = 7  # the code whose high byte is in the escape list
PAD = 64  # entries after the escape list: the kernel reads a whole vector at its cursor
NAMES = ("low_bytes", "planes", "escapes", "offsets", "table")
_CHUNK_VALUES = 1 << 22  # values encoded at once, to bound the int64 temporaries


def _lane_order() -> torch.Tensor:
    """The input each stored byte of a block holds: byte j of 128-bit lane L is input 8L + j (j < 8) or
    32 + 8L + j - 8, which is where the kernel's low / high byte interleaves put it."""
    p = torch.arange(BLOCK)
    lane, j = p // 16, p % 16
    return torch.where(j < 8, lane * 8 + j, 32 + lane * 8 + j - 8)


LANE_ORDER = _lane_order()


@dataclass
class LosslessForm:
    """One bf16 matrix `[N, K]` in the lossless form (module docstring)."""

    low_bytes: torch.Tensor  # uint8 [N, Kp], Kp = K rounded up to BLOCK, each block in LANE_ORDER
    planes: torch.Tensor  # int64 [N, Kp / BLOCK, 3]: bit p of plane b = bit b of stored byte p's code
    escapes: torch.Tensor  # uint8 [escaped values + PAD]: their high bytes
    offsets: torch.Tensor  # int64 [ceil(N / GROUP) + 1]
    table: torch.Tensor  # uint8 [8]: high bytes of codes 0-6 (entry 7 unused)
    in_features: int

    def tensors(self) -> dict[str, torch.Tensor]:
        return {name: getattr(self, name) for name in NAMES}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())


def encode(weight: torch.Tensor) -> LosslessForm:
    """A bf16 matrix `[N, K]` -> its lossless form (exact for every bit pattern)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2:
        raise ValueError(f"lossless weights are bf16 matrices, got {weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    bits = weight.detach().contiguous().view(torch.int16)
    table, lookup = _code_table(bits)
    kp = -(-k // BLOCK) * BLOCK
    low_bytes = torch.empty(n, kp, dtype=torch.uint8)
    planes = torch.empty(n, kp // BLOCK, 3, dtype=torch.int64)
    escapes, counts = [], torch.empty(n, dtype=torch.int64)
    padding = _stored_order((torch.arange(kp) >= k).view(1, -1))[0]
    step = max(1, _CHUNK_VALUES // max(1, kp))
    for r in range(0, n, step):
        rows = bits[r : r + step]
        b = torch.zeros(len(rows), kp, dtype=torch.int32)
        b[:, :k] = rows.to(torch.int32) & 0xFFFF
        b = _stored_order(b)
        high = b >> 8
        codes = lookup[high]
        codes[:, padding] = 0  # the padding: zero low bytes and code 0, never an escape
        escaped = codes == ESCAPE
        low_bytes[r : r + step] = (b & 0xFF).to(torch.uint8)
        escapes.append(high[escaped].to(torch.uint8))  # row-major, stored order: each row's after the last
        counts[r : r + step] = escaped.sum(1)
        planes[r : r + step] = _planes(codes)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    offsets = torch.cat([starts[:-1:GROUP], starts[-1:]])
    listed = torch.cat([*escapes, torch.zeros(PAD, dtype=torch.uint8)])
    return LosslessForm(low_bytes, planes, listed, offsets, table, k)


def _stored_order(values: torch.Tensor) -> torch.Tensor:
    """`[R, Kp]` in input order -> each block's values in LANE_ORDER."""
    return values.view(len(values), -1, BLOCK)[:, :, LANE_ORDER].reshape(len(values), -1)


def _code_table(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(table: uint8 [8], the high bytes of codes 0-6; lookup: int64 [256], every high byte's code)."""
    counts = torch.zeros(256, dtype=torch.int64)
    flat = bits.reshape(-1)
    for start in range(0, flat.numel(), _CHUNK_VALUES):
        high = (flat[start : start + _CHUNK_VALUES].to(torch.int32) >> 8) & 0xFF
        counts += torch.bincount(high, minlength=256)
    # the commonest first; ties by value, so the table does not depend on the sort's stability
    order = sorted(range(256), key=lambda h: (-int(counts[h]), h))[:ESCAPE]
    table = torch.zeros(8, dtype=torch.uint8)
    table[:ESCAPE] = torch.tensor(order, dtype=torch.uint8)
    lookup = torch.full((256,), ESCAPE, dtype=torch.int64)
    lookup[order] = torch.arange(ESCAPE)
    return table, lookup


def _planes(codes: torch.Tensor) -> torch.Tensor:
    """int64 codes `[R, Kp]` -> int64 bit-planes `[R, Kp / BLOCK, 3]` (bit p of plane b: bit b of code p)."""
    blocks = codes.reshape(len(codes), -1, BLOCK)
    bit = torch.arange(BLOCK)
    # sums of distinct powers of two wrap into the sign bit exactly as the uint64 the kernel reads
    return torch.stack([(((blocks >> b) & 1) << bit).sum(-1) for b in range(3)], -1)


def decode(form: LosslessForm) -> torch.Tensor:
    """The exact bf16 matrix back, in torch ops (the reference the kernel's decoding is tested against)."""
    n, kp = form.low_bytes.shape
    bit = torch.arange(BLOCK)
    codes = sum(((form.planes[..., b, None] >> bit) & 1) << b for b in range(3)).reshape(n, kp)
    high = form.table.to(torch.int64)[codes]
    escaped = codes == ESCAPE
    high[escaped] = form.escapes[: int(escaped.sum())].to(torch.int64)
    stored = (high << 8) | form.low_bytes.to(torch.int64)
    bits = torch.empty_like(stored)
    bits.view(n, -1, BLOCK)[:, :, LANE_ORDER] = stored.view(n, -1, BLOCK)
    bits = torch.where(bits >= 2**15, bits - 2**16, bits).to(torch.int16)
    return bits[:, : form.in_features].contiguous().view(torch.bfloat16)


def form_of(module: LosslessLinear | LosslessEmbedding) -> LosslessForm:
    """The form a lossless module holds (its current buffers)."""
    return LosslessForm(*(getattr(module, name) for name in NAMES), module.in_features)


class _Holds(nn.Module):
    """A module that holds a `LosslessForm` as buffers."""

    in_features: int

    def _hold(self, form: LosslessForm) -> None:
        self.in_features = form.in_features
        for name, tensor in form.tensors().items():
            self.register_buffer(name, tensor)

    def _args(self) -> list[torch.Tensor]:
        return [getattr(self, name) for name in NAMES]

    @property
    def weight(self) -> torch.Tensor:
        """The bf16 matrix, decoded whole (for code that reads a weight: a tied head in `F.linear`)."""
        return ops.lossless_decode(self.in_features, *self._args())

    def weight_nbytes(self) -> int:
        return form_of(self).nbytes()


class LosslessLinear(_Holds):
    """`nn.Linear` with its bf16 weight in the lossless form: products of at most `max_rows` rows run through
    `lossless_gemv` (the same sums as `GemvLinear`'s `bf16_gemv`), wider ones through torch's GEMM on the
    weight decoded for the call."""

    # As GemvLinear: none takes the kernel until the engine sets its runtime's limit (model/decode_ops.py).
    max_rows: int = 0

    def __init__(self, form: LosslessForm, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self._hold(form)
        self.out_features = int(form.low_bytes.shape[0])
        self.register_buffer("bias", bias)

    def uses_kernel(self, x: torch.Tensor) -> bool:
        rows = x.numel() // self.in_features if self.in_features else 0
        return x.dtype == torch.bfloat16 and 0 < rows <= self.max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.uses_kernel(x):
            return F.linear(x, self.weight, self.bias)
        y = ops.lossless_gemv(x.reshape(-1, self.in_features), *self._args())
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_into(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`forward` for 2-D `x` into `out` (`[M, out_features]`, fp32 or bf16), as GemvLinear's."""
        if not self.uses_kernel(x):
            return out.copy_(F.linear(x, self.weight, self.bias))
        ops.lossless_gemv_out(x, *self._args(), out)
        if self.bias is not None:
            out.add_(self.bias)
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, lossless"


class LosslessEmbedding(_Holds):
    """`nn.Embedding` over a bf16 table in the lossless form: a lookup decodes the rows it returns."""

    def __init__(self, form: LosslessForm) -> None:
        super().__init__()
        self._hold(form)
        self.num_embeddings = int(form.low_bytes.shape[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.lossless_rows(ids, self.in_features, *self._args())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.in_features}, lossless"


class LosslessExperts(_Holds):
    """A stack of experts' bf16 weights `[E, N, K]` in the lossless form, as one matrix of its E·N rows:
    expert e's rows are [e·N, (e+1)·N), whose escapes start at a group's offset (N a multiple of GROUP).
    Our MoE block (kernels/moe_block.cpp) multiplies each expert where it lies; the torch path decodes the
    stack (`weight`)."""

    def __init__(self, form: LosslessForm, num_experts: int) -> None:
        super().__init__()
        self._hold(form)
        self.num_experts = num_experts
        self.out_features = int(form.low_bytes.shape[0]) // num_experts

    @classmethod
    def of(cls, stack: torch.Tensor) -> LosslessExperts | None:
        """`stack` `[E, N, K]` (bf16, on CPU) in the form, or None where its experts' rows cannot be sliced
        at a group of escape offsets (N not a multiple of GROUP)."""
        if stack.dtype != torch.bfloat16 or stack.dim() != 3 or stack.device.type != "cpu":
            return None
        if stack.shape[1] % GROUP:
            return None
        experts, n, k = stack.shape
        return cls(encode(stack.detach().reshape(experts * n, k)), experts)

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.num_experts, self.out_features, self.in_features)

    @property
    def weight(self) -> torch.Tensor:
        return super().weight.view(self.shape)

    def extra_repr(self) -> str:
        return f"{self.num_experts} x ({self.in_features} -> {self.out_features}), lossless"


def use_lossless(model: nn.Module) -> int:
    """Replace the model's bf16 linear layers (`nn.Linear`, `GemvLinear`) and embeddings on CPU by lossless
    ones in place; a weight shared by several (a tied lm_head) is encoded once and its form shared. Returns
    how many modules changed."""
    forms: dict[int, LosslessForm] = {}
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            new = _lossless(child, forms)
            if new is not None:
                setattr(parent, name, new)
                swapped += 1
    return swapped


def _lossless(module: nn.Module, forms: dict[int, LosslessForm]) -> nn.Module | None:
    if type(module) not in (nn.Linear, GemvLinear, nn.Embedding):
        return None
    weight = module.weight
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if id(weight) not in forms:
        forms[id(weight)] = encode(weight)
    form = forms[id(weight)]
    if isinstance(module, nn.Embedding):
        return LosslessEmbedding(form)
    bias = module.bias.detach() if module.bias is not None else None
    return LosslessLinear(form, bias)
