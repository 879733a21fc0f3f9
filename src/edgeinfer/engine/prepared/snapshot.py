"""A prepared model as plain tensors plus a JSON description of what loading changed, and back.

Loading fills a freshly built model and then swaps modules (`nn.Linear` -> `QuantLinear`, float expert
stacks -> `QuantizedExperts`, GEMV re-layouts). A snapshot records, against a reference model built from
the same config, every module whose class differs (its class and plain attributes), and for every module
which of its tensors are parameters or buffers. Restoring rebuilds the swaps on a model built on the meta
device and assigns the stored tensors, so no weight is initialised, read or copied twice. Nothing here
knows a particular module type: a new prepared module is cached as long as its non-tensor state is made
of numbers, strings, dtypes and weight methods.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from edgeinfer.engine.quant.apply import set_submodule
from edgeinfer.engine.quant.base import WeightMethod, get_weight_method

# nn.Module's own bookkeeping (hooks, parameter dicts): rebuilt by nn.Module.__init__, never recorded.
_MODULE_INTERNALS = frozenset(vars(nn.Module())) - {"training"}
_SCALARS = (bool, int, float, str, type(None))


class NotCacheable(Exception):
    """The model holds state a snapshot cannot record; it is loaded afresh every time."""


def capture(model: nn.Module, reference: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """`(tensors, spec)`: the model's distinct tensors by name, and how to rebuild it on `reference`."""
    ref_modules = dict(reference.named_modules())
    tensors: dict[str, torch.Tensor] = {}
    stored: dict[int, str] = {}  # id(tensor) -> the name it is stored under (tied weights share one)
    storages: set[int] = set()
    swapped, slots = [], {}
    for name, module in model.named_modules():
        ref = ref_modules.get(name)
        if any(isinstance(v, torch.Tensor) for v in vars(module).values()):
            raise NotCacheable(f"module {name or '<root>'} keeps a tensor outside its parameters and buffers")
        if ref is None or type(ref) is not type(module):
            swapped.append({"name": name, "class": _class_path(module), "attrs": _attributes(module)})
        slots[name] = _slots(module, name, tensors, stored, storages)
    return tensors, {"swapped": swapped, "slots": slots}


def restore(model: nn.Module, tensors: dict[str, torch.Tensor], spec: dict[str, Any]) -> nn.Module:
    """Rebuild `spec`'s swaps on `model` (built on the meta device) and assign `tensors`; return it."""
    for entry in spec["swapped"]:
        _swap(model, entry["name"], _new_module(entry["class"], entry["attrs"]))
    params: dict[str, nn.Parameter] = {}
    for name, slots in spec["slots"].items():
        module = model.get_submodule(name) if name else model
        _drop_unrecorded(module, slots)
        for local, (kind, source, persistent) in slots.items():
            module._parameters.pop(local, None)
            module._buffers.pop(local, None)
            tensor = None if source is None else tensors[source]
            if kind == "param":
                if tensor is not None and source not in params:
                    params[source] = nn.Parameter(tensor, requires_grad=False)
                module._parameters[local] = None if source is None else params[source]
            else:
                module.register_buffer(local, tensor, persistent=persistent)
    _check_materialised(model)
    return model


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    """Put `new` at dotted `name`. Loading may have replaced a tensor by a module of the same name (a float
    expert stack by its quantized one), so the reference's parameter or buffer there makes way first."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    parent._parameters.pop(child, None)
    parent._buffers.pop(child, None)
    parent._non_persistent_buffers_set.discard(child)
    set_submodule(model, name, new)


def _drop_unrecorded(module: nn.Module, slots: dict[str, list]) -> None:
    """Remove the reference's tensors that the captured module no longer held (loading deleted them), so
    none stays behind on the meta device."""
    for table in (module._parameters, module._buffers):
        for local in [n for n in table if n not in slots]:
            del table[local]
    module._non_persistent_buffers_set.intersection_update(slots)


def _slots(
    module: nn.Module, prefix: str, tensors: dict, stored: dict[int, str], storages: set[int]
) -> dict[str, list]:
    """`local name -> [param|buffer, stored name or None, persistent]`, storing tensors not seen yet."""
    slots: dict[str, list] = {}
    persistent = {n for n in module._buffers if n not in module._non_persistent_buffers_set}
    for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
        for local, tensor in table.items():
            full = f"{prefix}.{local}" if prefix else local
            slots[local] = [kind, _store(full, tensor, tensors, stored, storages), local in persistent]
    return slots


def _store(name: str, tensor: torch.Tensor | None, tensors: dict, stored: dict[int, str], storages: set[int]):
    if tensor is None:
        return None
    if id(tensor) in stored:
        return stored[id(tensor)]
    data = tensor.detach()
    if data.device.type != "cpu":
        raise NotCacheable(f"{name} is on {data.device}")
    ptr = data.untyped_storage().data_ptr()
    # safetensors stores each tensor on its own; views into a storage already stored become copies
    if ptr in storages or not data.is_contiguous():
        data = data.contiguous().clone()
    storages.add(data.untyped_storage().data_ptr())
    stored[id(tensor)] = name
    tensors[name] = data
    return name


def _attributes(module: nn.Module) -> dict[str, Any]:
    return {k: _encode(module, k, v) for k, v in vars(module).items() if k not in _MODULE_INTERNALS}


def _encode(module: nn.Module, key: str, value: Any) -> Any:
    if isinstance(value, _SCALARS):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, _SCALARS) for v in value):
        return {"tuple" if isinstance(value, tuple) else "list": list(value)}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, WeightMethod):
        return {"method": value.name, "options": value.options()}
    raise NotCacheable(f"{type(module).__name__}.{key} is a {type(value).__name__}")


def _decode(value: Any) -> Any:
    if not isinstance(value, dict):
        return value
    if "tuple" in value:
        return tuple(value["tuple"])
    if "list" in value:
        return list(value["list"])
    if "dtype" in value:
        return getattr(torch, value["dtype"])
    return get_weight_method(value["method"], **value["options"])


def _class_path(module: nn.Module) -> str:
    cls = type(module)
    if "<locals>" in cls.__qualname__:
        raise NotCacheable(f"{cls.__qualname__} is a local class")
    return f"{cls.__module__}:{cls.__qualname__}"


def _new_module(path: str, attrs: dict[str, Any]) -> nn.Module:
    """An instance of the class at `path` with `attrs`, its tensors still to be assigned."""
    module_name, _, qualname = path.partition(":")
    cls: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ValueError(f"{path} is not a module class")
    module = cls.__new__(cls)
    nn.Module.__init__(module)
    for key, value in attrs.items():
        object.__setattr__(module, key, _decode(value))
    return module


def _check_materialised(model: nn.Module) -> None:
    """Every tensor the model holds is real: a plain tensor attribute (not a parameter or buffer) set at
    build time would still be on the meta device, and the model cannot be restored this way."""
    for name, module in model.named_modules():
        tensors = [*module._parameters.values(), *module._buffers.values()]
        tensors += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
        if any(t is not None and t.is_meta for t in tensors):
            raise NotCacheable(f"module {name or '<root>'} keeps a tensor the snapshot does not hold")
