"""Encoder (embedding) model registry keyed by the checkpoint's `architectures`, beside the causal LMs'."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from edgeinfer.engine.model.bert import BertArgs, BertEncoder
from edgeinfer.engine.model.hf_config import ConfigError

EncoderBuilder = Callable[[dict[str, Any], str], nn.Module]

_ENCODERS: dict[str, EncoderBuilder] = {
    # MiniLM, BGE and E5 (English) all ship as BertModel.
    "BertModel": lambda cfg, attention: BertEncoder(BertArgs.from_hf(cfg), attention),
}


def is_encoder_config(cfg: dict[str, Any]) -> bool:
    return any(arch in _ENCODERS for arch in cfg.get("architectures") or [])


def build_encoder(cfg: dict[str, Any], attention: str) -> nn.Module:
    for arch in cfg.get("architectures") or []:
        if arch in _ENCODERS:
            return _ENCODERS[arch](cfg, attention)
    raise ConfigError(
        f"unsupported encoder {cfg.get('architectures')}; supported: {', '.join(sorted(_ENCODERS))}"
    )
