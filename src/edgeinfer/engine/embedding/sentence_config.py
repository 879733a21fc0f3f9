"""What a sentence-transformers directory declares around its encoder: pooling, normalisation, length.

`modules.json` lists the pipeline (Transformer → Pooling → optional Normalize); `1_Pooling/config.json`
the pooling mode; `sentence_bert_config.json` the maximum sequence length inputs are truncated to.
A plain HF directory without `modules.json` gets mean pooling without normalisation, as
sentence-transformers itself assumes for such a directory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgeinfer.engine.model.loader.errors import CheckpointError

# Older configs set one boolean per mode; newer ones name the mode. Ours are the names pool() knows.
_MODE_FLAGS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
}
_UNSUPPORTED_FLAGS = ("pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class SentenceConfig:
    pooling: str
    normalize: bool
    max_seq_length: int


def read_sentence_config(directory: Path, config: dict[str, Any]) -> SentenceConfig:
    """The pipeline `directory` declares; `config` is its config.json (for the position limit)."""
    max_pos = int(config.get("max_position_embeddings", 512))
    modules = _read_json(directory / "modules.json")
    if modules is None:
        return SentenceConfig("mean", False, min(max_pos, _tokenizer_max_length(directory) or max_pos))
    kinds = [str(m.get("type", "")).rpartition(".")[2] for m in modules]
    unknown = [k for k in kinds if k not in _KNOWN_MODULES]
    if unknown:
        raise CheckpointError(
            f"{directory}/modules.json: unsupported module(s) {unknown} (Pooling, Normalize)"
        )
    pooling_path = next(
        (m.get("path", "") for m in modules if str(m.get("type", "")).endswith("Pooling")), None
    )
    if pooling_path is None:
        raise CheckpointError(f"{directory}/modules.json: no Pooling module, so no sentence vector")
    mode = _pooling_mode(directory / pooling_path / "config.json")
    st = _read_json(directory / "sentence_bert_config.json") or {}
    limit = st.get("max_seq_length") or _tokenizer_max_length(directory) or max_pos
    return SentenceConfig(mode, "Normalize" in kinds, min(int(limit), max_pos))


def _pooling_mode(path: Path) -> str:
    cfg = _read_json(path)
    if cfg is None:
        raise CheckpointError(f"{path}: missing pooling config")
    if isinstance(cfg.get("pooling_mode"), str):
        if cfg["pooling_mode"] not in _MODE_FLAGS.values():
            raise CheckpointError(f"{path}: pooling mode {cfg['pooling_mode']!r} unsupported")
        return cfg["pooling_mode"]
    if any(cfg.get(flag) for flag in _UNSUPPORTED_FLAGS):
        raise CheckpointError(f"{path}: pooling modes {_UNSUPPORTED_FLAGS} are unsupported")
    modes = [mode for flag, mode in _MODE_FLAGS.items() if cfg.get(flag)]
    if len(modes) != 1:
        raise CheckpointError(f"{path}: expected exactly one pooling mode, found {modes or 'none'}")
    return modes[0]


def _tokenizer_max_length(directory: Path) -> int | None:
    value = (_read_json(directory / "tokenizer_config.json") or {}).get("model_max_length")
    # HF writes a huge sentinel (1e30) when the tokenizer sets no limit.
    return int(value) if isinstance(value, int | float) and value < 1e9 else None


def _read_json(path: Path) -> Any:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path}: unreadable ({exc})") from exc
