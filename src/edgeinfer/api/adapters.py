"""Tenants' LoRA adapters as the tenants file declares them (torch-free; the engine checks the weights).

```toml
[[tenants.adapters]]
name = "support"                 # requests name it as `model: "gemma-3-270m:support"` or Workers AI's `lora`
model = "gemma-3-270m"           # the base it was trained on (a name or alias the node serves)
path = "/srv/adapters/support"   # a PEFT directory: adapter_config.json + adapter_model.safetensors
```

An adapter belongs to its tenant: another tenant naming it gets the 404 of an adapter that does not exist.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.api.errors import ApiError, model_not_found

# As the engine's adapter names (engine/lora/registry.py): no ':' (it separates base and adapter).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class TenantAdapter:
    name: str
    model: str
    path: str
    revision: str = ""  # an uploaded finetune's: each revision of its files registers anew

    def engine_name(self, tenant: str) -> str:
        """The adapter's name on the engine: distinct per tenant, so two tenants' `support` never meet."""
        key = adapter_key(tenant, self.name)
        return f"{key}.{self.revision}" if self.revision else key


def adapter_key(tenant: str, name: str) -> str:
    """A tenant's adapter as nodes report it resident and routers look for it (the tenant's name hashed)."""
    return f"{hashlib.sha256(tenant.encode()).hexdigest()[:16]}.{name}"


def parse_adapters(value: Any, where: str) -> dict[str, TenantAdapter]:
    if not isinstance(value, list):
        raise ValueError(f"{where}.adapters: must be a list of tables ([[tenants.adapters]])")
    found: dict[str, TenantAdapter] = {}
    for i, entry in enumerate(value):
        at = f"{where}.adapters[{i}]"
        if not isinstance(entry, dict) or set(entry) != {"name", "model", "path"}:
            raise ValueError(f"{at}: needs exactly `name`, `model` and `path`")
        name, model, path = entry["name"], entry["model"], entry["path"]
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValueError(f"{at}.name: 1-64 letters, digits or ._- (no ':'), got {name!r}")
        if not isinstance(model, str) or not model or not isinstance(path, str):
            raise ValueError(f"{at}: `model` and `path` must be strings")
        missing = [f for f in _FILES if not (Path(path) / f).is_file()]
        if missing:
            raise ValueError(f"{at}: {path} lacks {', '.join(missing)}")
        if name in found:
            raise ValueError(f"{at}: duplicate adapter name {name!r}")
        found[name] = TenantAdapter(name, model, path)
    return found


def split_model(name: str) -> tuple[str, str | None]:
    """`base:adapter` -> (base, adapter); a name without ':' -> (name, None)."""
    base, sep, adapter = name.rpartition(":")
    return (base, adapter) if sep and base and adapter else (name, None)


def no_such_adapter(model: str, adapter: str) -> ApiError:
    """The same 404 whether the adapter does not exist or belongs to another tenant."""
    return model_not_found(f"adapter {adapter!r} does not exist for model {model!r}")
