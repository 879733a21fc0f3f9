"""Optional `torch.compile` of the dense decoder layers (`EngineConfig.compile`).

A CPU decode step of a small model is mostly Python dispatch of small ops; inductor fuses each layer's
norms, rope, residuals and activation into a few C++ loops (the quantized matmuls stay library calls).
The paged attention stays eager: its per-step metadata is Python lists and dicts. One compiled function
serves every layer (the layer is an argument), and shapes are dynamic, so a step of any size reuses it.

Compiling needs a C++ compiler at run time; when it fails the layers run eagerly, with a warning, rather
than the engine failing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn

from edgeinfer.engine.model.dense import DecoderLayer

log = logging.getLogger(__name__)


class _CompiledOrEager:
    """`fn` compiled on first use; eager from the first compile failure on."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.compiled: Callable[..., Any] | None = torch.compile(fn, dynamic=True)

    def __call__(self, *args: Any) -> Any:
        if self.compiled is not None:
            try:
                return self.compiled(*args)
            except Exception as e:  # any backend failure: no compiler, an unsupported op
                log.warning("torch.compile of %s failed, running it eagerly: %s", self.fn.__qualname__, e)
                self.compiled = None
        return self.fn(*args)


def compile_decoder_layers(model: nn.Module) -> bool:
    """Route each dense decoder layer's tensor-only parts through compiled functions.

    Returns False (and changes nothing) for models without dense decoder layers.
    """
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    if not layers:
        return False
    # the cache of compiled graphs is per code object: allow a few per layer kind and step shape
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    pre = _CompiledOrEager(DecoderLayer.pre_attention)
    post = _CompiledOrEager(DecoderLayer.post_attention)
    for layer in layers:
        # instance attributes shadow the methods, so `DecoderLayer.forward` calls the compiled ones
        layer.pre_attention = partial(pre, layer)
        layer.post_attention = partial(post, layer)
    return True
