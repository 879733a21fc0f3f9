"""Activation-aware input scaling before weight quantization (the AWQ idea, searched per layer).

For a linear layer `y = x @ W.T`, any positive per-input-channel vector `c` gives the same float result
as `y = (x / c) @ (W * c).T`. Quantizing `W * c` instead of `W` moves precision to the input channels that
carry large activations, and (for int8 activations) shrinks the outlier channels that set each token's
int8 step. `c = mean|x|^alpha`, with `alpha` chosen per layer on calibration inputs to minimise the
quantized layer's output error (`alpha = 0`, no scaling, is a candidate, so the search never makes the
calibration error worse). The `1 / c` is folded into the op that produces `x` (an RMSNorm's weight, or the
`up` rows of a gated MLP feeding `down_proj`), so the quantized model runs exactly the same kernels.

Which producer feeds which layer is model structure; `smoothing_groups` knows the dense decoder layer
(Llama, Qwen3, Gemma 3) and the final norm -> lm_head pair. Layers it does not recognise (MoE experts,
MLA) are left as they are, and so is `o_proj` (its input comes from attention over shared KV heads, so
one scale would have to fit several query heads). A tied lm_head stays tied: the embedding table becomes
the scaled weight and its lookups multiply the scale back out (`ScaledEmbedding`), so the two still share
one quantized copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from edgeinfer.engine.quant.base import QuantizationError, WeightMethod
from edgeinfer.engine.quant.calibrate import WINDOW, InputSample, Prefill, calibration_windows, collect_inputs
from edgeinfer.engine.quant.gptq import gptq_int4
from edgeinfer.engine.quant.int4 import Int4Method

log = logging.getLogger(__name__)

ALPHAS = tuple(i / 10 for i in range(11))
SEARCH_ROWS = 4096  # output rows a scale search looks at, at most (about)

#: scales the producer's output channels by `inv` and returns the factor actually applied (after the
#: producer's weight was rounded to its dtype), so the consumer can use exactly its inverse
Fold = Callable[[torch.Tensor], torch.Tensor]


@dataclass
class SmoothGroup:
    """Linear layers that share one input, and the op producing that input."""

    name: str
    linears: list[tuple[str, nn.Linear]]
    fold: Fold
    #: the module `fold` edits; when it is a linear layer (its rows) it turns fp32, so it must be quantized
    producer: str
    producer_is_linear: bool = False


@dataclass
class SmoothReport:
    """Per group: the chosen scale and the relative output error without and with scaling."""

    chosen: dict[str, tuple[str, float, float]] = field(default_factory=dict)
    #: per scaled layer: the factor its input now carries (x * factor), for later searches on its inputs
    input_factor: dict[str, torch.Tensor] = field(default_factory=dict)
    #: every module whose weight changed (scaled layers, the norms and rows they folded into, int4 layers)
    changed: set[str] = field(default_factory=set)
    #: per int4 layer: its quantized state, to use instead of quantizing its (float) weight
    states: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.chosen:
            return "no layers scaled"
        before = sum(v[1] for v in self.chosen.values()) / len(self.chosen)
        after = sum(v[2] for v in self.chosen.values()) / len(self.chosen)
        return (
            f"scaled {len(self.chosen)} layer inputs; mean relative output error {before:.2e} -> {after:.2e}"
        )


def fold_into_norm(norm: nn.Module) -> Fold:
    """Scale an RMSNorm's output per channel (both conventions: `w * x̂` and Gemma's `(1 + w) * x̂`)."""

    def fold(inv: torch.Tensor) -> torch.Tensor:
        w = norm.weight
        offset = 1.0 if getattr(norm, "unit_offset", False) else 0.0
        old = w.detach().float() + offset
        new = (old * inv).sub_(offset).to(w.dtype)
        with torch.no_grad():
            w.copy_(new)  # bumps the version counter, so cached fp32 scales are rebuilt
        # a channel the norm zeroes stays zero whatever its scale: report 1 so its weights are left alone
        return torch.where(old == 0, torch.ones_like(old), (new.float() + offset) / old)

    return fold


def fold_into_rows(linear: nn.Linear, start: int, stop: int) -> Fold:
    """Scale output rows `[start, stop)` of a linear layer (its weight becomes fp32, exact)."""

    def fold(inv: torch.Tensor) -> torch.Tensor:
        _to_fp32(linear)
        with torch.no_grad():
            linear.weight[start:stop] *= inv[:, None]
            if linear.bias is not None:
                linear.bias[start:stop] *= inv.to(linear.bias.dtype)
        return inv

    return fold


class ScaledEmbedding(nn.Module):
    """Lookups in a table whose columns were multiplied by `1 / factor`: rows come back times `factor`."""

    def __init__(self, inner: nn.Module, factor: torch.Tensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.inner = inner
        self.dtype = dtype
        self.register_buffer("factor", factor.float())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.inner(ids).float() * self.factor).to(self.dtype)


def smoothing_groups(model: nn.Module) -> Iterator[SmoothGroup]:
    """The groups of a dense decoder, per layer `down_proj` first (its fold edits `gate_up_proj`'s rows,
    which `gate_up_proj`'s own search must then see), then the lm_head."""
    yield from _layer_groups(model)
    head, norm = getattr(model, "lm_head", None), getattr(getattr(model, "model", None), "norm", None)
    if isinstance(head, nn.Linear) and isinstance(norm, nn.Module) and hasattr(norm, "weight"):
        yield SmoothGroup("lm_head", [("lm_head", head)], fold_into_norm(norm), "model.norm")


def _layer_groups(model: nn.Module) -> Iterator[SmoothGroup]:
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    for i, layer in enumerate(layers):
        prefix = f"model.layers.{i}"
        mlp = getattr(layer, "mlp", None)
        gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
        if isinstance(gate_up, nn.Linear) and isinstance(down, nn.Linear):
            inter = mlp.intermediate
            yield SmoothGroup(
                f"{prefix}.mlp.down_proj",
                [(f"{prefix}.mlp.down_proj", down)],
                fold_into_rows(gate_up, inter, 2 * inter),  # the `up` half: down's input is act(gate) * up
                f"{prefix}.mlp.gate_up_proj",
                producer_is_linear=True,
            )
            norm_name = (
                "pre_feedforward_layernorm"
                if getattr(layer, "sandwich", False)
                else "post_attention_layernorm"
            )
            yield SmoothGroup(
                f"{prefix}.mlp.gate_up_proj",
                [(f"{prefix}.mlp.gate_up_proj", gate_up)],
                fold_into_norm(getattr(layer, norm_name)),
                f"{prefix}.{norm_name}",
            )
        qkv = getattr(getattr(layer, "self_attn", None), "qkv_proj", None)
        if isinstance(qkv, nn.Linear):
            name = f"{prefix}.self_attn.qkv_proj"
            norm = f"{prefix}.input_layernorm"
            yield SmoothGroup(name, [(name, qkv)], fold_into_norm(layer.input_layernorm), norm)


def smooth_model(
    model: nn.Module,
    method: WeightMethod,
    samples: dict[str, InputSample],
    skip: Callable[[str], bool] = lambda name: False,
    alphas: tuple[float, ...] = ALPHAS,
    head_method: WeightMethod | None = None,
) -> SmoothReport:
    """Search and apply input scales for every recognised group whose layers will all be quantized
    (`head_method`, if given, is the lm_head's method).

    Scaled layers keep fp32 weights (so the product `W * c` is not rounded twice); quantize them next.
    """
    report = SmoothReport()
    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    for group in smoothing_groups(model):
        names = [n for n, _ in group.linears]
        if any(skip(n) or n not in samples for n in names) or (
            group.producer_is_linear and skip(group.producer)
        ):
            continue
        sample = samples[names[0]]
        weights = [lin.weight.detach() for _, lin in group.linears]
        m = head_method if group.name == "lm_head" and head_method is not None else method
        label, scale, err0, err = search_scale(sample, weights, m, sample.dtype, alphas)
        report.chosen[group.name] = (label, err0, err)
        if label == "mean^0":
            continue
        applied = group.fold(1.0 / scale)  # the producer now outputs x * applied
        report.changed.add(group.producer)
        for name, lin in group.linears:
            tied = isinstance(embed, nn.Embedding) and embed.weight is lin.weight
            _to_fp32(lin)
            with torch.no_grad():
                lin.weight /= applied[None, :]
            report.input_factor[name] = applied
            report.changed.add(name)
            if tied:
                table = nn.Embedding.from_pretrained(lin.weight, freeze=True)
                table.weight = lin.weight  # the very same Parameter: quantized once, shared
                model.model.embed_tokens = ScaledEmbedding(table, applied, embed.weight.dtype)
    log.info("activation-aware scaling: %s", report.summary())
    return report


def candidate_scales(
    sample: InputSample, alphas: tuple[float, ...] = ALPHAS
) -> Iterator[tuple[str, torch.Tensor]]:
    """(label, scale) pairs `mean|x|^a`, centred on 1; channels that are always 0 keep 1 (e.g. behind a
    norm weight of 0). SmoothQuant's `max|x|^a / max|w|^(1-a)` is not a second family: it fits the
    calibration rows better and the eval text worse (docs/quantization.md)."""
    live = sample.abs_mean > 0
    for alpha in alphas:
        base = sample.abs_mean.pow(alpha)
        c = torch.ones_like(base)
        if live.any():
            c[live] = base[live] / (base[live].max() * base[live].min()).sqrt()
        yield f"mean^{alpha:g}", c


def search_scale(
    sample: InputSample,
    weights: list[torch.Tensor],
    method: WeightMethod,
    dtype: torch.dtype,
    alphas: tuple[float, ...] = ALPHAS,
) -> tuple[str, torch.Tensor, float, float]:
    """(label, scale, error unscaled, error scaled) minimising the summed relative output error of the
    quantized layers on the calibration rows (`mean^0`, unscaled, is the first candidate)."""
    x = sample.rows
    # Rows quantize independently, so an even subset of a wide layer's output rows estimates its error;
    # the 262k-row Gemma lm_head otherwise costs a vocabulary-wide matmul per candidate. Only the subset is
    # widened to fp32: a widened copy of a whole lm_head would be the largest allocation of a load.
    weights = [w[:: max(1, w.shape[0] // SEARCH_ROWS)].float() for w in weights]
    refs = [x @ w.t() for w in weights]
    norm = sum(float(r.square().sum()) for r in refs) or 1.0
    best: tuple[str, torch.Tensor, float] | None = None
    err0 = 0.0
    for label, c in candidate_scales(sample, alphas):
        xs = (x / c).to(dtype)
        outs = (_quantized_matmul(method, w * c, xs) for w in weights)
        err = sum(float((o - r).square().sum()) for o, r in zip(outs, refs, strict=True)) / norm
        if best is None:
            err0 = err
        if best is None or err < best[2]:
            best = (label, c, err)
    assert best is not None
    return best[0], best[1], err0, best[2]


def _quantized_matmul(method: WeightMethod, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    # int4 scores each scale on fitted grids, as it will be stored (most of int4's load time): ranking them
    # on min/max grids instead picks scales that serve the stored grids worse
    prepared = method.prepare(method.quantize(weight), x.device)
    return method.apply(prepared, x).float()


def _to_fp32(linear: nn.Linear) -> None:
    if linear.weight.dtype != torch.float32:
        linear.weight = nn.Parameter(linear.weight.detach().float(), requires_grad=False)


def _grouped(
    model: nn.Module, method: Int4Method, samples: dict[str, InputSample]
) -> Iterator[tuple[str, nn.Linear, InputSample]]:
    """The sampled linear layers whose inputs divide into the method's groups."""
    modules = dict(model.named_modules())
    for name, sample in samples.items():
        lin = modules[name]
        if lin.weight.shape[-1] % method.group_size == 0:
            yield name, lin, sample


def round_model(
    model: nn.Module, method: Int4Method, samples: dict[str, InputSample], report: SmoothReport
) -> None:
    """Quantize every sampled int4 linear on grids fitted under its input energies (`Int4Method.fit`),
    rounded to nearest or, for layers with a Hessian, by GPTQ (quant/gptq.py); the states land in
    `report.states`. The samples were taken before scaling: a layer whose input now carries a factor `f`
    sees energies `E[x^2] f^2` and the Hessian `diag(f) H diag(f)`."""
    gptq = 0
    for name, lin, sample in _grouped(model, method, samples):
        weight = lin.weight.detach().float()
        factor = report.input_factor.get(name)
        h, energy = sample.hessian, sample.sq_mean
        if factor is not None:
            energy = energy * factor.square()
            h = None if h is None else h * factor[:, None] * factor[None, :]
        if h is None:
            report.states[name] = method.quantize(weight, energy)
        else:
            report.states[name] = gptq_int4(method, weight, h, energy)
            gptq += 1
        report.changed.add(name)
    log.info("int4: %d layers on energy-weighted grids, %d of them rounded by GPTQ", len(report.states), gptq)


def scale_for_quantization(
    model: nn.Module,
    method: WeightMethod,
    token_ids: list[int],
    bos_token_id: int | None,
    prefill: Prefill,
    skip: Callable[[str], bool] = lambda name: False,
    head_method: WeightMethod | None = None,
    gptq: bool = False,
) -> SmoothReport:
    """Calibrate on `token_ids` (the float model's activations, each window run through `prefill`), scale
    the recognised layers' inputs (the lm_head's only with a `head_method`), then quantize int4 decoder
    layers on energy-weighted grids into `report.states`, with `gptq` (int4 only) rounded by GPTQ instead
    of to nearest."""
    if gptq and not isinstance(method, Int4Method):
        raise QuantizationError(f"GPTQ calibration is for int4 weights, not {method.name}")
    has_head = isinstance(getattr(model, "lm_head", None), nn.Linear)  # tied MoE models compute it inline
    names = decoder_linears(model) + (["lm_head"] if head_method is not None and has_head else [])
    max_pos = getattr(getattr(model, "args", None), "max_pos", WINDOW + 1)
    windows = calibration_windows(token_ids, bos_token_id, min(WINDOW, max_pos - 1))
    samples = collect_inputs(model, windows, names, prefill, hessians=gptq)
    report = smooth_model(model, method, samples, skip, head_method=head_method)
    decoder = {n: s for n, s in samples.items() if n != "lm_head" and not skip(n)}
    if isinstance(method, Int4Method):
        round_model(model, method, decoder, report)
    return report


def decoder_linears(model: nn.Module) -> list[str]:
    """Names of the plain linear layers inside the decoder layers (not the lm_head, not fused experts)."""
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and ".layers." in f".{n}"]
