"""`edgeinfer quantize`: float safetensors checkpoint -> compressed-tensors checkpoint that loads as is."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from edgeinfer.engine.model.loader.conversion import CheckpointSource, write_output_files
from edgeinfer.engine.quant.apply import SkipRule, is_lm_head, make_skip
from edgeinfer.engine.quant.base import QuantizationError, WeightMethod
from edgeinfer.engine.quant.checkpoint import QuantizationConfig

log = logging.getLogger(__name__)

OUTPUT_FILE = "model.safetensors"


@dataclass
class QuantizeReport:
    """What `quantize_checkpoint` did."""

    quantized: list[str] = field(default_factory=list)
    #: matrices left in float (skipped, lm_head/embeddings, or not quantizable)
    ignored: list[str] = field(default_factory=list)
    #: other tensors copied as they are (norms, biases)
    copied: int = 0
    bytes_in: int = 0
    bytes_out: int = 0

    def summary(self) -> str:
        ratio = self.bytes_out / self.bytes_in if self.bytes_in else 0.0
        return (
            f"quantized {len(self.quantized)} matrices, kept {len(self.ignored)} in float; "
            f"{self.bytes_in / 2**20:.1f} MiB -> {self.bytes_out / 2**20:.1f} MiB ({ratio:.1%})"
        )


def is_embedding(module: str) -> bool:
    """Embedding tables by their usual names."""
    last = module.rsplit(".", 1)[-1]
    return "embed" in last or last in ("wte", "wpe")


def quantize_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]],
    method: WeightMethod,
    want: Callable[[str], bool],
    report: QuantizeReport,
    states: dict[str, dict[str, torch.Tensor]] | None = None,
) -> dict[str, torch.Tensor]:
    """Quantize every `M.weight` (2-D, or 3-D stacked experts) for which `want(M)`; keep the rest.
    A module in `states` is written with that state (already quantized with `method`)."""
    given = states or {}
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors:
        report.bytes_in += t.numel() * t.element_size()
        module = name.removesuffix(".weight")
        matrix = name.endswith(".weight") and t.dim() in (2, 3) and t.is_floating_point()
        state = None
        if matrix and want(module) and module in given:
            state = given[module]
        elif matrix and want(module):
            try:
                state = method.quantize(t)
            except QuantizationError as e:  # e.g. in_features not a multiple of the int4 group
                log.warning("keeping %s in float: %s", name, e)
        if state is None:
            out[name] = t.contiguous()
            if matrix:
                report.ignored.append(module)
            else:
                report.copied += 1
        else:
            out.update({f"{module}.{k}": v.contiguous() for k, v in state.items()})
            report.quantized.append(module)
    report.bytes_out = sum(v.numel() * v.element_size() for v in out.values())
    return out


def quantize_checkpoint(
    source: CheckpointSource,
    dst: Path,
    method: WeightMethod,
    *,
    skip: SkipRule = None,
    quantize_lm_head: bool = False,
    quantize_embeddings: bool = False,
) -> QuantizeReport:
    """Write `dst` (config with `quantization_config`, `model.safetensors`, tokenizer files) from `source`."""
    if source.config.get("quantization_config"):
        raise QuantizationError(f"{source.label} is already quantized")
    skipped = make_skip(skip)

    def want(module: str) -> bool:
        if skipped(module):
            return False
        if is_lm_head(module):
            return quantize_lm_head
        return quantize_embeddings or not is_embedding(module)

    report = QuantizeReport()
    out = quantize_tensors(source.tensors, method, want, report, source.states)
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, str(dst / OUTPUT_FILE), metadata={"format": "pt"})
    qcfg = QuantizationConfig(method.name, method.options().get("group_size"), tuple(report.ignored))
    write_output_files(dst, source, {**source.config, "quantization_config": qcfg.to_hf()})
    log.info("%s", report.summary())
    return report
