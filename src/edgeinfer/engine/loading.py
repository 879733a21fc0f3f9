"""Building a ready model from a checkpoint: dtype choice, weights, KV pool sizing."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn

from edgeinfer.engine.attention import KVCacheStorage
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.model.loader import Checkpoint
from edgeinfer.engine.model.registry import build_model

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineLayout:
    """Values measured at start-up (never written back into the frozen config)."""

    num_kv_blocks: int
    block_size: int
    max_model_len: int
    kv_bytes_per_token: int
    weight_bytes: int
    dtype: torch.dtype

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.block_size * self.kv_bytes_per_token


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16: fast on modern CPUs and GPUs (fp16 matmuls are ~500x slower on these CPUs)."""
    if name == "auto":
        return torch.bfloat16
    return _DTYPES[name]


def load_model(ckpt: Checkpoint, dtype: torch.dtype, device: torch.device) -> nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype if dtype.is_floating_point else torch.float32)
    try:
        with torch.device(device):
            model = build_model(ckpt.config)
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(ckpt.iter_tensors(dtype))
    return model.eval().requires_grad_(False)


def plan_layout(config: EngineConfig, model: nn.Module, dtype: torch.dtype) -> EngineLayout:
    per_token = KVCacheStorage.bytes_per_token(model.kv_spec, dtype)
    blocks = config.num_kv_blocks or max(1, config.kv_cache_memory_bytes // (per_token * config.block_size))
    max_len = min(config.max_model_len or model.args.max_pos, model.args.max_pos)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights += sum(b.numel() * b.element_size() for b in model.buffers())
    return EngineLayout(blocks, config.block_size, max_len, per_token, weights, dtype)
