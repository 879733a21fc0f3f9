"""Optional `torch.compile` of one-sequence decode steps (`EngineConfig.compile`).

A CPU decode step of a small model at one sequence is mostly Python dispatch of small ops (Gemma 3 270M:
~2,100 torch calls, ~11 ms of a ~28 ms step). A step that decodes exactly one sequence runs the whole
model forward, paged attention included, as one inductor graph with a C++ wrapper, so it no longer goes
through Python op by op; the quantized matmuls stay library calls. Every other step runs eagerly: a
batched step spreads the per-op cost over its sequences, and its Python-level shape (the batch size, the
prefill chunks) recompiles the graph, minutes each (measured: serving at 8 concurrent requests with
batched decodes compiled, TPOT p50 went to 886 ms). The context length is dynamic, so the one graph lasts.

Measured on Gemma 3 270M int4 with `--lm-head-gemv`, 1 thread: one sequence 28.0 -> 20.5 ms a step
in-process, serving TPOT p50 28.4 -> 21.4 ms; compiling takes ~2-3 minutes on first use. Inductor's fused
fp32 intermediates can change greedy tokens, so it is opt-in. Compiling needs a C++ compiler at run time;
when it fails the steps run eagerly, with a warning, rather than the engine failing.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


class DecodeCompiledForward:
    """`model(...)`, through one compiled graph for one-sequence decode steps; eager after a failure."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # cpp_wrapper: the graph's own launcher is C++ too, which is where a small step's time goes
        self.compiled: Any = torch.compile(model.forward, dynamic=True, options={"cpp_wrapper": True})

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, backend: Any, single_decode: bool) -> Any:
        if single_decode and self.compiled is not None:
            try:
                # scalar reads (`.item()`, the step's context lengths) stay inside the graph
                with torch._dynamo.config.patch(capture_scalar_outputs=True):
                    return self.compiled(ids, positions, backend)
            except Exception as e:  # any backend failure: no compiler, an unsupported op
                log.warning("torch.compile of one-sequence decode steps failed, running them eagerly: %s", e)
                self.compiled = None
        return self.model(ids, positions, backend)
