"""Optional `torch.compile` of one-sequence decode steps (`EngineConfig.compile`).

A CPU decode step of a small model at one sequence is mostly Python dispatch of small ops (thousands of torch
calls a step). A step that decodes exactly one sequence runs the whole model forward, paged attention
included, as one inductor graph with a C++ wrapper, so it no longer goes through Python op by op; the
quantized matmuls stay library calls. Every other step runs eagerly: a batched step spreads the per-op cost
over its sequences, and its Python-level shape (the batch size, the prefill chunks) recompiles the graph,
minutes each, which would stall serving while graphs compile. The context length is dynamic, so the one graph
lasts.

A compiled one-sequence step is markedly faster than an eager one (docs/engine.md), at the price of
minutes of compiling on first use.
Each start traces the step again (Dynamo); what it compiles comes from AOTAutograd's and inductor's caches
on disk (`use_persistent_compile_cache`), which is why the graph holds no `torch.tensor` call: AOTAutograd
refuses to cache such a graph (tests/engine/test_compile_models.py checks it is kept).
Inductor's fused fp32 intermediates can change greedy tokens, so it is opt-in. Compiling needs a C++
compiler at run time; when it fails the steps run eagerly, with a warning, rather than the engine failing.
"""

from __future__ import annotations

import logging
import os
import types
from pathlib import Path
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)


def use_persistent_compile_cache(root: Path) -> None:
    """Keep inductor's caches (FX graphs, AOTAutograd artifacts, built C++ wrappers) under `root`
    unless the user chose a directory (`TORCHINDUCTOR_CACHE_DIR`): inductor's default lives in /tmp,
    which a reboot or a container restart empties, and a cold cache costs minutes of compiling.
    Set before the first compile: inductor reads the variable whenever it looks for its cache."""
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))


class DecodeCompiledForward:
    """`model(...)`, through one compiled graph for one-sequence decode steps; eager after a failure."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        # cpp_wrapper: the graph's own launcher is C++ too, which is where a small step's time goes.
        # guard_filter_fn: no guards on the model's modules and the code's globals, which nothing changes
        # once loaded (the model's forward reads module state and writes none when compiling); checking
        # thousands of guards costs a noticeable share of a decode step. Guards on the step's inputs stay.
        # Without module guards, nothing tells two models of one class apart, and dynamo keeps its graphs
        # per code object: so each model compiles a forward with a code object of its own, as one graph
        # (fullgraph: code resumed after a graph break would be shared again). Otherwise a second model
        # of the class with another int8 rotation would run the first one's graph and decode garbage.
        options = {"cpp_wrapper": True, "guard_filter_fn": _skip_model_and_global_guards}
        forward = _own_code(model)
        self.compiled: Any = torch.compile(forward, dynamic=True, fullgraph=True, options=options)

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


def _own_code(model: nn.Module) -> Any:
    """`model.forward` bound to a copy of its function whose code object belongs to this model alone."""
    fn = type(model).forward
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{id(model):x}")
    copy = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    return types.MethodType(copy, model)


def _skip_model_and_global_guards(entries: list[Any]) -> list[bool]:
    """Keep a guard unless it checks an `nn.Module`'s state or a module-level global."""
    nn_modules = torch.compiler.skip_guard_on_all_nn_modules_unsafe(entries)
    globals_ = torch.compiler.skip_guard_on_globals_unsafe(entries)
    return [a and b for a, b in zip(nn_modules, globals_, strict=True)]
