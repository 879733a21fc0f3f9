"""Building the draft model's runner for `--speculative-method self` or `draft` (runner/draft.py)."""

from __future__ import annotations

import logging

import torch
from torch import nn

from edgeinfer.engine.attention.storage import KVCacheStorage
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.kernels.limits import KernelLimits
from edgeinfer.engine.kv_cache.groups import mirror_groups
from edgeinfer.engine.loading import EngineLayout, load_model, uses_cpu_gemv, weight_bytes
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.runner.draft import DraftRunner
from edgeinfer.engine.runner.draft_head import DraftHead, corpus_text, frequent_tokens
from edgeinfer.engine.runner.runner import ModelRunner
from edgeinfer.engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


def load_draft_model(
    config: EngineConfig, tokenizer: Tokenizer, dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The draft model: the served one as int4, or `config.draft_model` (which must speak its tokens)."""
    draft_config = config.draft_config()
    ckpt = open_checkpoint(draft_config.model)
    if config.draft_model is not None:
        _check_vocabulary(tokenizer, Tokenizer.from_checkpoint(ckpt))
    return load_model(ckpt, dtype, device, draft_config, lambda: tokenizer)


def build_draft_runner(
    config: EngineConfig,
    layout: EngineLayout,
    model: nn.Module,
    tokenizer: Tokenizer,
    device: torch.device,
    kernel_limits: KernelLimits,
) -> DraftRunner:
    """The draft model's runner over KV storage of its own, mirroring the target's blocks (counted in
    `layout`: loading.py `plan_layout`), and its head over the most frequent tokens."""
    windows = model.kv_spec.layer_windows()
    groups = mirror_groups(layout.kv_groups, windows, layout.max_model_len, config.hybrid_kv_cache)
    storage = KVCacheStorage(
        model.kv_spec,
        layout.num_kv_blocks,
        layout.block_size,
        layout.dtype,
        device,
        config.kv_cache_dtype,
        groups,
    )
    limits = kernel_limits if uses_cpu_gemv(model) else None
    runner = ModelRunner(model, storage, device, backend=config.attention_backend, decode_ops=limits)
    corpus = tokenizer.encode(corpus_text(), add_special_tokens=False)
    ids = frequent_tokens(corpus, set(tokenizer.eos_token_ids), tokenizer.vocab_size, config.draft_vocab_size)
    head = DraftHead(model, tokenizer.vocab_size, ids, cpu_gemv=limits is not None)
    log.info(
        "draft model %s (%s): %.0f MiB of weights, head over %d tokens, fused decode step: %s",
        config.draft_config().model,
        config.speculative_method,
        weight_bytes(model) / 2**20,
        head.size,
        runner.fused is not None,
    )
    return DraftRunner(runner, head)


def _check_vocabulary(target: Tokenizer, draft: Tokenizer) -> None:
    """A draft model must speak the target's tokens: the same vocabulary size and the same ids for a text."""
    text = corpus_text()
    if draft.vocab_size != target.vocab_size or draft.encode(text) != target.encode(text):
        raise ValueError("the draft model's tokenizer differs from the served model's")
