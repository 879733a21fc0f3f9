"""Tiny random checkpoints for structured-output tests: a byte-level BPE trained on JSON and tool-call text,
so that many tokens close strings and objects (a random model then finishes a JSON document within a few
dozen tokens; the grammar alone decides that what it writes is valid), plus each family's special tokens
and chat template."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from helpers.tiny_models import make_tiny

JSON_CORPUS = [
    json.dumps({"name": "Ada", "age": 36, "tags": ["math", "code"], "ok": True, "score": 9.5}),
    json.dumps({"city": "Paris", "unit": "celsius", "days": [1, 2, 3], "note": None}),
    json.dumps({"id": "a1-b2", "items": [{"sku": "X", "qty": 2}], "email": "a@b.io"}),
    json.dumps({"date": "2024-05-01", "time": "12:30:00Z", "ip": "10.0.0.1", "level": "high"}),
    'Sure, "yes" or "no"? {"answer": "no", "reason": "it is late"}',
] * 6

# Special tokens every tiny structured tokenizer has; each family's template uses its own subset.
SPECIALS = [
    "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>",
    "<|start_header_id|>", "<|end_header_id|>", "<|user|>", "<|assistant|>", "<|system|>", "<|observation|>",
    "<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>",
    "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>", "<|tool_call_end|>",
]  # fmt: skip
# Added (non-special) tokens, as Qwen3 and GLM-4.5 declare their tool and think tags.
TAGS = [
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<think>",
    "</think>",
]


def json_tokenizer_builder(
    eos: str = "</s>", chat_template: str | None = None
) -> Callable[[Path], PreTrainedTokenizerFast]:
    def build(path: Path) -> PreTrainedTokenizerFast:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=420,
            special_tokens=SPECIALS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        tok.train_from_iterator(JSON_CORPUS, trainer)
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS])
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<s>", eos_token=eos, pad_token="<pad>"
        )
        fast.chat_template = chat_template
        fast.save_pretrained(path)
        return fast

    return build


def make_structured_tiny(
    family: str, path: Path, eos: str = "</s>", chat_template: str | None = None, **overrides: object
) -> Path:
    builder = json_tokenizer_builder(eos, chat_template)
    return make_tiny(family, path, seed=0, tokenizer_builder=builder, **overrides)
