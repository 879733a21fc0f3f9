"""The engine's tokenizer: a HF fast tokenizer behind a small API, built from any checkpoint we can open.

A GGUF carries its vocabulary as metadata; transformers rebuilds a tokenizer from it (slow for a large
vocabulary such as Gemma's, mostly deriving the BPE merges), so the result is saved as tokenizer.json in the
checkpoint's `tokenizer_dir` and later starts load that instead.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgeinfer.engine.chat_messages import normalize_messages
from edgeinfer.engine.chat_templates import builtin_template, handles_tools, render_template
from edgeinfer.engine.direct_tokenizer import DirectTokenizer, read_chat_template, read_direct, read_specials
from edgeinfer.engine.model.loader import Checkpoint, CheckpointError
from edgeinfer.engine.model.loader.errors import one_line
from edgeinfer.engine.model.loader.gguf_file import GGUFFile
from edgeinfer.engine.spm_tokenizer import ADDED_FILE, MODEL_FILE, SpmTokenizer, agrees, read_spm, write_spm
from edgeinfer.structured.formats import FORMATS, THINKING_FORMATS, format_for
from edgeinfer.structured.prompt import json_form_messages

if TYPE_CHECKING:  # transformers is imported only where a tokenizer needs it (a large share of a start)
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# Tokens that end an assistant turn in the chat formats of common families; generation stops on them too.
END_OF_TURN_TOKENS = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>")
_SOURCE_STAMP = "edgeinfer_source.json"
_CACHE_FORMAT = 2  # 2: with the SentencePiece form where it reads alike; older caches are rebuilt once


class Tokenizer:
    """Text ↔ token ids for one model, plus its chat format and stop tokens."""

    def __init__(
        self,
        hf: PreTrainedTokenizerBase | DirectTokenizer,
        model_type: str | None = None,
        eos_ids: Iterable[int] = (),
    ) -> None:
        self.hf = hf
        self._template = builtin_template(model_type)
        turn_ends = {i for i in map(_token_id(hf), END_OF_TURN_TOKENS) if i is not None}
        own = {hf.eos_token_id} if hf.eos_token_id is not None else set()
        self.eos_token_ids: frozenset[int] = frozenset(own | turn_ends | set(eos_ids))
        self.vocab_size: int = len(hf)
        self.bos_token_id: int | None = hf.bos_token_id
        self.pad_token_id: int | None = hf.pad_token_id
        lookup = _token_id(hf)
        # The family's tool-call format (parser and forcing grammar), and whether answers may open with a
        # reasoning block. A template without a place for tools prompts for the JSON form, so it is parsed.
        family = format_for(model_type, lambda text: lookup(text) is not None)
        template = hf.chat_template if isinstance(hf.chat_template, str) else None
        self.tool_format = family if template and handles_tools(template) else FORMATS["json"]
        self.reasons = family.name in THINKING_FORMATS

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> Tokenizer:
        """The checkpoint's tokenizer: its own files, or one rebuilt from GGUF metadata (then cached)."""
        if ckpt.gguf_path is not None:
            hf = _gguf_tokenizer(ckpt.gguf_path, ckpt.tokenizer_dir)
        else:
            hf = _load_pretrained(ckpt.tokenizer_dir)
        eos = _config_eos_ids(ckpt.config) | _generation_config_eos_ids(ckpt.tokenizer_dir)
        return cls(hf, ckpt.config.get("model_type"), eos)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With `add_special_tokens`, BOS is added unless the text already starts with it
        (a rendered chat prompt usually does), so a prompt never begins with two BOS tokens."""
        if not isinstance(text, str):
            raise ValueError(f"text to encode must be a string, got {type(text).__name__}")
        ids = self.hf.encode(text, add_special_tokens=add_special_tokens)
        if add_special_tokens and len(ids) >= 2 and ids[0] == ids[1] == self.bos_token_id:
            del ids[0]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; ids outside the vocabulary raise ValueError."""
        self._check_ids(ids)
        # No clean-up of spaces before punctuation: it depends on neighbours, which breaks streaming.
        return self.hf.decode(
            list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def id_to_piece(self, token_id: int) -> str:
        """The vocabulary entry of one id, as stored (e.g. `▁world`, `<0xE4>`, `<end_of_turn>`)."""
        self._check_ids([token_id])
        return self.hf.convert_ids_to_tokens(int(token_id))

    def apply_chat_template(
        self,
        messages: Any,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """Render chat messages (and OpenAI-shaped `tools`) to a prompt string, with the checkpoint's own
        template when it has one. A template without a place for tools (and the built-in formats) gets
        them in the JSON tool form of `edgeinfer.structured.prompt`."""
        normalized = normalize_messages(messages)
        template = self.hf.chat_template if isinstance(self.hf.chat_template, str) else None
        if template is None or not handles_tools(template):
            normalized = json_form_messages(normalized, tools)
            tools = None
        if template is None:
            return self._template(normalized, add_generation_prompt, self.hf.bos_token or "")
        specials = {k: str(v) for k, v in self.hf.special_tokens_map.items() if isinstance(v, str)}
        return render_template(
            template,
            normalized,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            special_tokens=specials,
            extra=template_kwargs,
        )

    def token_ref(self, text: str) -> str:
        """`text` in llguidance's Lark: as its single token when the vocabulary has one, else literally."""
        token_id = _token_id(self.hf)(text)
        return f"<[{token_id}]>" if token_id is not None else json.dumps(text)

    def _check_ids(self, ids: Iterable[int]) -> None:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise ValueError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}")


def _token_id(hf: PreTrainedTokenizerBase | DirectTokenizer) -> Callable[[str], int | None]:
    """Look up a token's id, None when the vocabulary lacks it (HF would answer with the unknown id)."""

    def lookup(token: str) -> int | None:
        token_id = hf.convert_tokens_to_ids(token)
        return token_id if token_id is not None and hf.convert_ids_to_tokens(token_id) == token else None

    return lookup


# transformers resolves its names lazily on first use, and two threads doing that at once can see a half-made
# module (`cannot import name 'AutoTokenizer'`): the engine reads its tokenizer on a helper thread while the
# main thread may build one for calibration, and the pool loads models on worker threads. Loading holds the
# lock too: it imports the family's tokenizer module on the way.
_TRANSFORMERS = threading.Lock()


def _auto_tokenizer(*args: Any, **kwargs: Any) -> PreTrainedTokenizerBase:
    with _TRANSFORMERS:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(*args, **kwargs)


def _load_pretrained(directory: Path) -> PreTrainedTokenizerBase:
    try:
        return _auto_tokenizer(str(directory))
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        # AutoTokenizer reads config.json to pick a class, and fails on a model type transformers does not
        # know (Kimi K2's `kimi_k2`); a fast tokenizer's own files need no class of the model's
        if not (directory / "tokenizer.json").is_file():
            raise CheckpointError(f"{directory}: cannot load tokenizer ({one_line(exc)})") from exc
    try:
        return _fast_tokenizer(str(directory))
    except (OSError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{directory}: cannot load tokenizer ({one_line(exc)})") from exc


def _fast_tokenizer(directory: str) -> PreTrainedTokenizerBase:
    with _TRANSFORMERS:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(directory)


def _gguf_tokenizer(gguf_path: Path, cache_dir: Path) -> PreTrainedTokenizerBase | DirectTokenizer:
    stamp = _source_stamp(gguf_path)
    if _cached_stamp(cache_dir) == stamp:
        return _load_saved(cache_dir)
    log.info("building the tokenizer from %s's metadata (cached afterwards in %s)", gguf_path.name, cache_dir)
    try:
        hf = _auto_tokenizer(str(gguf_path.parent), gguf_file=gguf_path.name)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{gguf_path}: cannot build a tokenizer from GGUF metadata ({one_line(exc)})"
        ) from exc
    _save_cache(hf, cache_dir, stamp, gguf_path)
    return hf


def _load_saved(directory: Path) -> PreTrainedTokenizerBase | DirectTokenizer | SpmTokenizer:
    """The tokenizer we saved from GGUF metadata, read without transformers: its SentencePiece form where
    one was written (`SpmTokenizer`, the fastest to read), else tokenizer.json through `tokenizers`
    (`DirectTokenizer`). AutoTokenizer builds the family's class (Gemma's), which parses a large
    tokenizer.json in Python and then deep-copies the result, taking several times as long, on top of
    importing transformers. The saved files hold the normaliser, pre-tokenizer, post-processor and added
    tokens, so the result encodes alike (tests/tokenizer/test_tokenizer_api.py compares them)."""
    try:
        specials = read_specials(directory)
        if specials is None:
            return _load_pretrained(directory)
        fast = read_spm(directory, specials) or read_direct(directory, specials)
    except Exception as exc:  # tokenizers raises plain Exception; transformers may still read it
        log.warning("reading the saved tokenizer in %s directly failed (%s)", directory, one_line(exc))
        return _load_pretrained(directory)
    if fast is None:
        return _load_pretrained(directory)
    fast.chat_template = read_chat_template(directory)
    return fast


def _write_spm(directory: Path, gguf_path: Path, hf: PreTrainedTokenizerBase) -> None:
    """The SentencePiece form of a SentencePiece-vocabulary GGUF's tokenizer, kept only where it encodes
    and decodes a sample as `hf` does; any failure leaves tokenizer.json alone in the cache."""
    try:
        metadata = GGUFFile(gguf_path, keep_string_arrays={"tokenizer.ggml.tokens"}).metadata
        # With a dummy prefix (Llama 2's vocabulary) transformers prepends `▁` to the text's first section
        # only, SentencePiece to every piece it is handed between added tokens: Gemma's has none.
        if (
            metadata.get("tokenizer.ggml.model") != "llama"
            or "tokenizer.ggml.scores" not in metadata
            or metadata.get("tokenizer.ggml.add_space_prefix", True)
        ):
            return
        added = [
            {"id": i, "content": a.content, "special": a.special} for i, a in hf.added_tokens_decoder.items()
        ]
        write_spm(directory, metadata, added)
        specials = {k: v for k, v in hf.special_tokens_map.items() if isinstance(v, str)}
        spm = read_spm(directory, specials)
        kept = spm is not None and agrees(spm, hf)
    except (CheckpointError, OSError, RuntimeError, ValueError, KeyError) as exc:
        log.warning("%s: no SentencePiece form of the tokenizer (%s)", gguf_path, one_line(exc))
        kept = False
    if not kept:
        log.warning("%s: SentencePiece reads this vocabulary unlike transformers; not kept", gguf_path)
        for name in (MODEL_FILE, ADDED_FILE):
            (directory / name).unlink(missing_ok=True)


def _source_stamp(path: Path) -> dict[str, Any]:
    stat = path.stat()
    return {"file": path.name, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "format": _CACHE_FORMAT}


def _cached_stamp(cache_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((cache_dir / _SOURCE_STAMP).read_text())
    except (OSError, ValueError):
        return None


def _save_cache(hf: PreTrainedTokenizerBase, cache_dir: Path, stamp: dict[str, Any], gguf_path: Path) -> None:
    """Save atomically (a finished directory is renamed into place); a read-only place skips caching."""
    tmp = cache_dir.with_name(f".{cache_dir.name}.{os.getpid()}.tmp")
    try:
        hf.save_pretrained(str(tmp))
        _write_spm(tmp, gguf_path, hf)
        (tmp / _SOURCE_STAMP).write_text(json.dumps(stamp))
        if cache_dir.exists():
            shutil.rmtree(cache_dir)
        os.replace(tmp, cache_dir)
    except OSError as exc:
        log.warning("not caching the tokenizer in %s: %s", cache_dir, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _config_eos_ids(config: dict[str, Any]) -> set[int]:
    eos = config.get("eos_token_id")
    if eos is None:
        return set()
    return {int(i) for i in eos} if isinstance(eos, list) else {int(eos)}


def _generation_config_eos_ids(directory: Path) -> set[int]:
    """HF chat models often list their end-of-turn token only in generation_config.json."""
    try:
        config = json.loads((directory / "generation_config.json").read_text())
    except (OSError, ValueError):
        return set()
    return _config_eos_ids(config) if isinstance(config, dict) else set()
