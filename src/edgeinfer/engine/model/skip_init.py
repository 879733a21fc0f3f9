"""Building a model whose every parameter is then filled from a checkpoint, without random initialisation."""

from __future__ import annotations

from typing import Any

from torch.overrides import TorchFunctionMode

_INIT_OPS = frozenset({"normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "xavier_uniform_"})


class SkipInit(TorchFunctionMode):
    """`nn.init`'s random fills become no-ops inside this mode. For meta models (which the prepared-form
    cache fills) `normal_` alone imports torch's compiler stack, a large share of a start; for real tensors
    the fills are time thrown away, since loading overwrites every value. Only for models whose loader
    checks that every parameter was loaded."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _INIT_OPS:
            return args[0] if args else kwargs["tensor"]  # nn.init passes the tensor by keyword
        return func(*args, **kwargs)
