"""Calibration: the inputs a float model's linear layers see on a short text, for activation-aware scaling.

The default text (`data/calibration.txt`, written for this project: narrative, dialogue, news, how-to,
science, code and a letter, ~570 words) ships with the package, so quantizing needs no download; it is
deliberately unrelated to the `edgeinfer eval` text, so accuracy is not measured on what was calibrated.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from edgeinfer.engine.tokenizer import Tokenizer

WINDOW = 512  # tokens per calibration prefill
MAX_ROWS = 256  # input rows kept per layer for the scale search (the mean uses every row)
# Calibration tokens for GPTQ's Hessians: fewer leave int4 less accurate, more gain nothing and lengthen the
# load (docs/quantization.md compares the sizes).
GPTQ_TOKENS = 98304

# One window of token ids through the float model being calibrated -> its final hidden states [T, H]. The
# caller supplies it (engine/loading.py: a one-shot prefill), so calibration needs no attention of its own.
Prefill = Callable[[Sequence[int]], torch.Tensor]


@dataclass
class InputSample:
    """What one linear layer was fed: per-channel mean |x| and mean x^2 over every row, a subset of the
    rows, and (when asked for, for GPTQ) `X^T X` over every row."""

    abs_mean: torch.Tensor  # [in] fp32
    sq_mean: torch.Tensor  # [in] fp32
    rows: torch.Tensor  # [n, in] fp32
    dtype: torch.dtype = torch.float32  # what the layer was fed (the search feeds that dtype too)
    hessian: torch.Tensor | None = None  # [in, in] fp32


def default_calibration_text() -> str:
    return resources.files("edgeinfer.engine.quant").joinpath("data/calibration.txt").read_text("utf-8")


def calibration_ids(tokenizer: Tokenizer, gptq_text: str | None) -> list[int]:
    """Token ids to calibrate on: the built-in text, or with GPTQ the first `GPTQ_TOKENS` of its text
    (`enwiki` or a file; a layer's Hessian needs many more rows than the scale search)."""
    if gptq_text is None:
        return tokenizer.encode(default_calibration_text(), add_special_tokens=False)
    from edgeinfer.corpus import load_text

    ids: list[int] = []
    for doc in load_text(gptq_text).documents:  # tokenized a document at a time: only what is needed
        ids.extend(tokenizer.encode(doc + "\n", add_special_tokens=False))
        if len(ids) >= GPTQ_TOKENS:
            return ids[:GPTQ_TOKENS]
    return ids


def calibration_windows(
    ids: Sequence[int], bos_token_id: int | None, window: int = WINDOW
) -> list[list[int]]:
    """The token stream cut into prefills of at most `window` tokens, each after BOS when there is one."""
    if not ids:
        raise ValueError("the calibration text has no tokens")
    prefix = [] if bos_token_id is None else [bos_token_id]
    return [prefix + list(ids[i : i + window]) for i in range(0, len(ids), window)]


class _Recorder:
    """Forward hook accumulating one layer's inputs: every `keep_every`-th row is kept."""

    def __init__(self, keep_every: int, hessian: bool) -> None:
        self.keep_every = keep_every
        self.abs_sum: torch.Tensor | None = None
        self.sq_sum: torch.Tensor | None = None
        self.count = 0
        self.rows: list[torch.Tensor] = []
        self.dtype = torch.float32
        self.hessian: torch.Tensor | None = None
        self.want_hessian = hessian

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.dtype = args[0].dtype
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        total = x.abs().sum(0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        squares = x.square().sum(0)
        self.sq_sum = squares if self.sq_sum is None else self.sq_sum + squares
        first = -self.count % self.keep_every  # rows evenly spaced over the whole stream
        self.rows.append(x[first :: self.keep_every].clone())
        self.count += x.shape[0]
        if self.want_hessian:
            self.hessian = x.t() @ x if self.hessian is None else self.hessian.addmm_(x.t(), x)

    def sample(self) -> InputSample:
        assert self.abs_sum is not None and self.sq_sum is not None
        n = self.count
        return InputSample(self.abs_sum / n, self.sq_sum / n, torch.cat(self.rows), self.dtype, self.hessian)


@torch.no_grad()
def collect_inputs(
    model: nn.Module,
    windows: Sequence[Sequence[int]],
    layer_names: Iterable[str],
    prefill: Prefill,
    max_rows: int = MAX_ROWS,
    hessians: bool = False,
) -> dict[str, InputSample]:
    """Run the float model over `windows` (through `prefill`) and return the inputs of the named linear
    layers (with `hessians`, also `X^T X` of each decoder layer's inputs; not the lm_head's, which GPTQ
    leaves alone)."""
    keep_every = max(1, -(-sum(len(w) for w in windows) // max_rows))
    recorders = {name: _Recorder(keep_every, hessians and name != "lm_head") for name in layer_names}
    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_hook(rec) for name, rec in recorders.items()]
    head = recorders.get("lm_head")  # the lm_head runs outside forward: it is fed the final hidden states
    try:
        for ids in windows:
            hidden = prefill(ids)
            if head is not None:
                head(modules["lm_head"], (hidden,), hidden)
    finally:
        for h in handles:
            h.remove()
    return {name: rec.sample() for name, rec in recorders.items() if rec.count}
