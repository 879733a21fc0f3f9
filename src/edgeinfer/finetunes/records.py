"""A finetune's record and the checks every upload passes before it is stored (no torch: the serving engine
checks the weights against its base when it first registers them)."""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from edgeinfer.api.errors import ApiError, bad_request

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
ASSET_FILES = (CONFIG_FILE, WEIGHTS_FILE)
# Workers AI takes adapter files under 300 MB; a config is a few hundred bytes.
MAX_ASSET_BYTES = {CONFIG_FILE: 1 << 20, WEIGHTS_FILE: 300 * 1000 * 1000}
# An upload's whole body: the largest file and its form's framing.
MAX_UPLOAD_BODY_BYTES = MAX_ASSET_BYTES[WEIGHTS_FILE] + (1 << 20)
_ASSET_PATH = re.compile(r"^/accounts/[^/]+/ai/finetunes/[^/]+/finetune-assets$")
MAX_RANK = 64
MAX_FINETUNES_PER_TENANT = 256
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")  # no ':' (it separates base and adapter)
_MAX_DESCRIPTION = 1024
_SAFETENSORS_DTYPES = {"F32", "F16", "BF16"}
_MAX_HEADER_BYTES = 100 << 20


@dataclass(frozen=True, kw_only=True)
class Finetune:
    """One tenant's finetune; `assets` maps each uploaded file's name to its sha256."""

    id: str
    tenant: str
    name: str
    model: str
    description: str = ""
    created_at: float = field(default_factory=time.time)
    modified_at: float = 0.0
    assets: dict[str, str] = field(default_factory=dict)

    @property
    def complete(self) -> bool:
        return all(name in self.assets for name in ASSET_FILES)

    @property
    def revision(self) -> str:
        """Changes with any asset: an engine registers each revision under its own name."""
        joined = "".join(self.assets.get(name, "-") for name in ASSET_FILES)
        return hashlib.sha256(joined.encode()).hexdigest()[:12]

    def with_asset(self, file_name: str, digest: str) -> Finetune:
        return replace(self, assets={**self.assets, file_name: digest}, modified_at=time.time())

    def public(self) -> dict[str, Any]:
        """As Workers AI lists a finetune."""
        return {
            "id": self.id,
            "name": self.name,
            "model": self.model,
            "description": self.description,
            "created_at": _iso(self.created_at),
            "modified_at": _iso(self.modified_at or self.created_at),
            "public": False,
        }

    def encode(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> Finetune:
        return cls(**json.loads(data))


def body_limit(path: str, default: int) -> int:
    """The most body bytes a request to `path` may send: an asset upload may send an adapter's weights."""
    return max(default, MAX_UPLOAD_BODY_BYTES) if _ASSET_PATH.match(path) else default


def _iso(ts: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ts))


def new_finetune(tenant: str, value: Any) -> Finetune:
    """The finetune a create call's body describes (400 naming the field at fault); `model` as given."""
    if not isinstance(value, dict):
        raise bad_request("the body must be a JSON object with `model` and `name`")
    name, model, description = value.get("name"), value.get("model"), value.get("description", "")
    if not isinstance(name, str) or not _NAME.match(name):
        raise bad_request("name: 1-64 letters, digits or ._- (no ':'), a letter or digit first", "name")
    if not isinstance(model, str) or not model:
        raise bad_request("model: the base model's name is required", "model")
    if description is None:
        description = ""
    if not isinstance(description, str) or len(description) > _MAX_DESCRIPTION:
        raise bad_request(f"description: a string of at most {_MAX_DESCRIPTION} characters", "description")
    if value.get("public"):
        raise bad_request("public finetunes are not offered: a finetune belongs to its account", "public")
    return Finetune(id=str(uuid.uuid4()), tenant=tenant, name=name, model=model, description=description)


def check_asset(file_name: str, data: bytes) -> None:
    """400 for an asset that could never serve: a wrong file name, an oversized file, a config that is no
    PEFT LoRA config of rank <= 64, a weights file that is no safetensors file of float tensors."""
    if file_name not in ASSET_FILES:
        raise bad_request(f"file_name must be {CONFIG_FILE} or {WEIGHTS_FILE}", "file_name")
    limit = MAX_ASSET_BYTES[file_name]
    if len(data) > limit:
        raise bad_request(f"{file_name} is {len(data)} bytes, over the {limit}-byte limit", "file")
    if file_name == CONFIG_FILE:
        _check_config(data)
    else:
        _check_safetensors(data)


def _check_config(data: bytes) -> None:
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise bad_request(f"{CONFIG_FILE} is not valid JSON: {exc}", "file") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        raise bad_request(f"{CONFIG_FILE} must be a PEFT config with peft_type 'LORA'", "file")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or not 1 <= rank <= MAX_RANK:
        raise bad_request(f"{CONFIG_FILE}: r must be an integer from 1 to {MAX_RANK}, got {rank!r}", "file")


def _check_safetensors(data: bytes) -> None:
    """The header only (8-byte length, JSON of name -> dtype, shape, offsets) and that the data it
    describes is all there: the weights themselves are the engine's to check."""
    why = _safetensors_problem(data)
    if why:
        raise bad_request(f"{WEIGHTS_FILE} is not a safetensors file of LoRA weights: {why}", "file")


def _safetensors_problem(data: bytes) -> str | None:
    if len(data) < 8:
        return "shorter than its header"
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(len(data) - 8, _MAX_HEADER_BYTES):
        return "its header runs past the end of the file"
    try:
        header = json.loads(data[8 : 8 + size])
    except (UnicodeDecodeError, json.JSONDecodeError):
        return "its header is not JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict) or entry.get("dtype") not in _SAFETENSORS_DTYPES:
            return f"tensor {name!r} is not F32, F16 or BF16"
        offsets = entry.get("data_offsets")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"tensor {name!r} has no data offsets"
        end = max(end, offsets[1])
    if len(header) - ("__metadata__" in header) == 0:
        return "it holds no tensors"
    if 8 + size + end > len(data):
        return "its tensors run past the end of the file"
    return None


def not_found(finetune: str) -> ApiError:
    """The same 404 for a finetune that does not exist and for another account's."""
    return ApiError(404, f"no finetune {finetune!r} in this account", code="not_found", param="finetune_id")
