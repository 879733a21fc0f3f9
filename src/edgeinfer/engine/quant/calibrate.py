"""Calibration: the inputs a float model's linear layers see on a short text, for activation-aware scaling.

The default text (`data/calibration.txt`, written for this project: narrative, dialogue, news, how-to,
science, code and a letter, ~570 words) ships with the package, so quantizing needs no download; it is
deliberately unrelated to the `edgeinfer eval` text, so accuracy is not measured on what was calibrated.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from importlib import resources

import torch
from torch import nn

from edgeinfer.engine.attention.oneshot import prefill_hidden

WINDOW = 512  # tokens per calibration prefill
MAX_ROWS = 256  # input rows kept per layer for the scale search (the mean uses every row)


@dataclass
class InputSample:
    """What one linear layer was fed: per-channel mean |x| over every row, and a subset of the rows."""

    abs_mean: torch.Tensor  # [in] fp32
    rows: torch.Tensor  # [n, in] fp32
    dtype: torch.dtype = torch.float32  # what the layer was fed (the search feeds that dtype too)


def default_calibration_text() -> str:
    return resources.files("edgeinfer.engine.quant").joinpath("data/calibration.txt").read_text("utf-8")


def calibration_windows(
    ids: Sequence[int], bos_token_id: int | None, window: int = WINDOW
) -> list[list[int]]:
    """The token stream cut into prefills of at most `window` tokens, each after BOS when there is one."""
    if not ids:
        raise ValueError("the calibration text has no tokens")
    prefix = [] if bos_token_id is None else [bos_token_id]
    return [prefix + list(ids[i : i + window]) for i in range(0, len(ids), window)]


class _Recorder:
    """Forward hook accumulating one layer's inputs."""

    def __init__(self) -> None:
        self.abs_sum: torch.Tensor | None = None
        self.count = 0
        self.rows: list[torch.Tensor] = []
        self.dtype = torch.float32

    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.dtype = args[0].dtype
        x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
        total = x.abs().sum(0)
        self.abs_sum = total if self.abs_sum is None else self.abs_sum + total
        self.count += x.shape[0]
        self.rows.append(x)

    def sample(self, max_rows: int) -> InputSample:
        rows = torch.cat(self.rows)
        step = max(1, -(-rows.shape[0] // max_rows))  # evenly spaced rows cover every window
        return InputSample(self.abs_sum / self.count, rows[::step].contiguous(), self.dtype)


@torch.no_grad()
def collect_inputs(
    model: nn.Module,
    windows: Iterable[Sequence[int]],
    layer_names: Iterable[str],
    dtype: torch.dtype,
    device: torch.device,
    max_rows: int = MAX_ROWS,
) -> dict[str, InputSample]:
    """Run the float model over `windows` and return the inputs of the named linear layers."""
    recorders = {name: _Recorder() for name in layer_names}
    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_hook(rec) for name, rec in recorders.items()]
    head = recorders.get("lm_head")  # the lm_head runs outside forward: it is fed the final hidden states
    try:
        for ids in windows:
            hidden = prefill_hidden(model, ids, dtype, device)
            if head is not None:
                head(modules["lm_head"], (hidden,), hidden)
    finally:
        for h in handles:
            h.remove()
    return {name: rec.sample(max_rows) for name, rec in recorders.items() if rec.count}
