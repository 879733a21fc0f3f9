"""One sequence through a model outside the engine: a single prefill into a throwaway paged cache.

Used by whatever needs a model's activations without scheduling (calibration, teacher-forced scoring);
it takes the same attention backend and KV storage as serving, so a quantized KV cache is written and
read back exactly as in the engine.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from edgeinfer.engine.attention.backend import get_attention_backend
from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.storage import KVCacheStorage

BLOCK_SIZE = 16


def prefill_hidden(
    model: nn.Module,
    input_ids: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """Final hidden states [T, H] of `input_ids` prefilled in one step."""
    n = len(input_ids)
    num_blocks = -(-n // BLOCK_SIZE)
    storage = KVCacheStorage(model.kv_spec, num_blocks, BLOCK_SIZE, dtype, device, kv_cache_dtype)
    backend = get_attention_backend("torch", storage)
    # Blocks 1..num_blocks in order (0 is the null block), so a token's flat slot is its position + one block.
    meta = AttentionMetadata(
        torch.arange(n, device=device) + BLOCK_SIZE,
        [0],
        [n],
        [n],
        torch.arange(1, num_blocks + 1, device=device)[None],
        0,
        BLOCK_SIZE,
    )
    backend.begin(meta)
    return model(torch.tensor(list(input_ids), device=device), torch.arange(n, device=device), backend)
