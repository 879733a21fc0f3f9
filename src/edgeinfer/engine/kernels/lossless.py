"""Lossless resident bf16 weights: a form that keeps every bit of a bf16 matrix in about 70 % of its bytes and
that `lossless_gemv` (lossless_gemv.cpp) multiplies where it lies (docs/lossless-weights.md).

A bf16 value is a sign bit, 8 exponent bits and 7 mantissa bits. Sign and mantissa stay raw, one byte a
weight (the sign in its top bit). The exponents of a trained matrix gather on a few values, so each gets a
3-bit code: codes 0-6 index the matrix's table of its seven commonest exponents, code 7 escapes to the next
entry of a list of whole exponents (kept as the bf16 exponent field, `e << 7` in 16 bits, which the kernel
merges as it is: fewer instructions a block than bytes would need, for a bit or so more in a hundred
weights). The codes are stored as three bit-planes (uint32) per block of 32 inputs, which decode into a
vector with a few mask instructions; the escapes of a row follow the previous row's, and `offsets` holds
where every group of `GROUP` rows begins, so groups decode independently (one thread a group, or one
embedding row). Rows are padded to whole blocks; the padding decodes to zero and is never read as weight.

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

BLOCK = 32  # inputs per block of codes (one `vdpbf16ps` chunk)
GROUP = 16  # rows per escape offset (lossless_gemv.cpp kGroup)
ESCAPE = 7  # the code whose exponent is in the escape list
PAD = 32  # entries after the escape list: the kernel reads a whole vector at its cursor
NAMES = ("sign_mantissa", "planes", "escapes", "offsets", "table")
_CHUNK_VALUES = 1 << 22  # values encoded at once, to bound the int64 temporaries


@dataclass
class LosslessForm:
    """One bf16 matrix `[N, K]` in the lossless form (module docstring)."""

    sign_mantissa: torch.Tensor  # uint8 [N, Kp], Kp = K rounded up to BLOCK
    planes: torch.Tensor  # int32 [N, Kp / BLOCK, 3]: bit i of plane b = bit b of input i's code
    escapes: torch.Tensor  # int16 [escaped values + PAD]: their exponent fields, e << 7
    offsets: torch.Tensor  # int64 [ceil(N / GROUP) + 1]
    table: torch.Tensor  # int16 [8]: exponents of codes 0-6 (entry 7 unused)
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
    sign_mantissa = torch.zeros(n, kp, dtype=torch.uint8)
    planes = torch.empty(n, kp // BLOCK, 3, dtype=torch.int32)
    escapes, counts = [], torch.empty(n, dtype=torch.int64)
    step = max(1, _CHUNK_VALUES // max(1, kp))
    for r in range(0, n, step):
        b = bits[r : r + step].to(torch.int32) & 0xFFFF
        sign_mantissa[r : r + step, :k] = (((b >> 8) & 0x80) | (b & 0x7F)).to(torch.uint8)
        exponents = (b >> 7) & 0xFF
        codes = torch.zeros(len(b), kp, dtype=torch.int64)  # the padding: code 0, never an escape
        codes[:, :k] = lookup[exponents]
        escaped = codes[:, :k] == ESCAPE
        escapes.append((exponents[escaped] << 7).to(torch.int16))  # row-major: each row's after the last
        counts[r : r + step] = escaped.sum(1)
        planes[r : r + step] = _planes(codes)
    starts = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(counts, 0)])
    offsets = torch.cat([starts[:-1:GROUP], starts[-1:]])
    listed = torch.cat([*escapes, torch.zeros(PAD, dtype=torch.int16)])
    return LosslessForm(sign_mantissa, planes, listed, offsets, table, k)


def _code_table(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(table: int16 [8], the exponents of codes 0-6; lookup: int64 [256], every exponent's code)."""
    counts = torch.zeros(256, dtype=torch.int64)
    flat = bits.reshape(-1)
    for start in range(0, flat.numel(), _CHUNK_VALUES):
        exponents = (flat[start : start + _CHUNK_VALUES].to(torch.int32) >> 7) & 0xFF
        counts += torch.bincount(exponents, minlength=256)
    # the commonest first; ties by exponent, so the table does not depend on the sort's stability
    order = sorted(range(256), key=lambda e: (-int(counts[e]), e))[:ESCAPE]
    table = torch.zeros(8, dtype=torch.int16)
    table[:ESCAPE] = torch.tensor(order, dtype=torch.int16)
    lookup = torch.full((256,), ESCAPE, dtype=torch.int64)
    lookup[order] = torch.arange(ESCAPE)
    return table, lookup


def _planes(codes: torch.Tensor) -> torch.Tensor:
    """int64 codes `[R, Kp]` -> int32 bit-planes `[R, Kp / BLOCK, 3]` (bit i of plane b: bit b of code i)."""
    blocks = codes.reshape(len(codes), -1, BLOCK)
    weights = torch.ones(BLOCK, dtype=torch.int64) << torch.arange(BLOCK)
    planes = torch.stack([(((blocks >> b) & 1) * weights).sum(-1) for b in range(3)], -1)
    return torch.where(planes >= 2**31, planes - 2**32, planes).to(torch.int32)


def decode(form: LosslessForm) -> torch.Tensor:
    """The exact bf16 matrix back, in torch ops (the reference the kernel's decoding is tested against)."""
    n, kp = form.sign_mantissa.shape
    planes = form.planes.to(torch.int64) & 0xFFFFFFFF
    lanes = torch.arange(BLOCK)
    codes = sum(((planes[..., b, None] >> lanes) & 1) << b for b in range(3)).reshape(n, kp)
    exponents = form.table.to(torch.int64)[codes]
    escaped = codes == ESCAPE
    exponents[escaped] = form.escapes[: int(escaped.sum())].to(torch.int64) >> 7
    sm = form.sign_mantissa.to(torch.int64)
    bits = ((sm & 0x80) << 8) | (exponents << 7) | (sm & 0x7F)
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
        self.out_features = int(form.sign_mantissa.shape[0])
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
        self.num_embeddings = int(form.sign_mantissa.shape[0])

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return ops.lossless_rows(ids, self.in_features, *self._args())

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.in_features}, lossless"


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
