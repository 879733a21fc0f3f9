"""The draft model's greedy next token, over the whole vocabulary or over its most frequent tokens only.

A small model's lm_head is most of what a decode step reads (Gemma 3 270M: 262,144 × 640, ~60 % of its
weights), so a draft step that multiplies all of it costs nearly what the target's step costs and cannot pay
for itself. Restricted to the `size` most frequent tokens, the head is a fraction of that; a token outside
the set is simply never drafted, and verification keeps the output exact whatever the draft proposes.

Which tokens are frequent: those of the text shipped with the package (quant/data/calibration.txt) by their
count there, then the rest by id, which in BPE vocabularies (and Gemma's SentencePiece one, scored by id) is
the merge rank, common pieces first. The rows are the draft head's own, read back through the head itself
(so any head form, float or quantized, gives its own values), and kept in int8 (our int8 GEMV kernel where
it runs): half the bytes of bf16 for the same rows, and a draft's argmax needs no more.
"""

from __future__ import annotations

from collections import Counter
from importlib import resources

import torch
from torch import nn

from edgeinfer.engine.quant.layers import QuantLinear, logits_fp32

_PROBE_ROWS = 64  # identity rows per pass when reading the head back: [64, vocab] fp32 at a time


def frequent_tokens(encode_ids: list[int], special: set[int], vocab: int, size: int) -> list[int]:
    """The `size` token ids most likely in text: `special` ones (EOS: a draft may end the output), those of
    `encode_ids` (an encoded corpus) by count, then the rest by id."""
    chosen = dict.fromkeys(t for t in sorted(special) if t < vocab)
    chosen.update(dict.fromkeys(t for t, _ in Counter(encode_ids).most_common() if t < vocab))
    ids = iter(range(vocab))
    while len(chosen) < min(size, vocab):
        chosen.setdefault(next(ids))
    return list(chosen)[:size]


def corpus_text() -> str:
    """The English text the package ships (the quantization calibration text)."""
    return resources.files("edgeinfer.engine.quant").joinpath("data/calibration.txt").read_text("utf-8")


class DraftHead:
    """`__call__(hidden) -> token ids`: the argmax of the draft model's logits, over `token_ids` only where
    given (an int8 head of those rows), else over the first `vocab_limit` logits of its own head."""

    def __init__(
        self, model: nn.Module, vocab_limit: int, token_ids: list[int] | None = None, cpu_gemv: bool = False
    ) -> None:
        self.model = model
        self.vocab_limit = vocab_limit
        self.ids: torch.Tensor | None = None
        self.head: QuantLinear | None = None
        if token_ids is not None and len(token_ids) < vocab_limit:
            self.ids = torch.tensor(token_ids, dtype=torch.long)
            self.head = QuantLinear.from_float(_head_rows(model, self.ids), method="int8")
            if cpu_gemv:  # our kernels are loaded: the form their int8 GEMV reads
                self.head.use_cpu_gemv()

    @property
    def size(self) -> int:
        return self.vocab_limit if self.ids is None else len(self.ids)

    def __call__(self, hidden: torch.Tensor) -> list[int]:
        # a final softcap (tanh) keeps the order of the logits, so the argmax needs none
        if self.head is None or self.ids is None:
            return self.model.compute_logits(hidden)[:, : self.vocab_limit].argmax(-1).tolist()
        return self.ids[logits_fp32(self.head, hidden).argmax(-1)].tolist()


@torch.inference_mode()
def _head_rows(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the model's lm_head as fp32 `[len(ids), hidden]`: its output for unit inputs."""
    head = model.lm_head
    hidden = model.args.hidden
    dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
    cols = []
    for start in range(0, hidden, _PROBE_ROWS):
        rows = torch.arange(min(_PROBE_ROWS, hidden - start))
        eye = torch.zeros(len(rows), hidden, dtype=dtype)
        eye[rows, start + rows] = 1
        cols.append(logits_fp32(head, eye)[:, ids])
    return torch.cat(cols).T.contiguous()
