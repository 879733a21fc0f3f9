"""llama.cpp's own 4-bit quantizer on our int4 source, scored by our eval harness: how hard is int4 here?

The default model's weights are the Q4_K_M GGUF dequantized (mostly Q5_0, some Q4_K / Q6_K / Q8_0 grids).
This converts that file to BF16 (exact) and has llama-quantize write, with every block tensor at one type
(`--pure`) and the token embedding in Q8_0 (as our int4 keeps an int8 lm_head):

- Q4_1 (groups of 32, asymmetric: our int4's format class) and Q4_0 (groups of 32, symmetric);
- Q4_1 with an importance matrix (`llama-imatrix` over the same Wikipedia tokens our GPTQ calibrates on,
  `GPTQ_TOKENS` of them): llama.cpp's best effort in this format class.

It loads each file in our engine and scores it, next to our own int4 (GPTQ on the same text, run as
`serve --quantization int4` runs it), against the default model on `edgeinfer eval`'s text (2,048 tokens,
windows of 512, stride 256 by default), all in one pass:

    python bench/int4_reference.py [--tokens 2048] [--stride 256]

It prints one markdown row per model; docs/quantization.md quotes them.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "src"))

import peers  # noqa: E402

from edgeinfer.corpus import load_text  # noqa: E402
from edgeinfer.engine.config import EngineConfig  # noqa: E402
from edgeinfer.engine.engine import LLMEngine  # noqa: E402
from edgeinfer.engine.model.loader.default_model import resolve_default_model  # noqa: E402
from edgeinfer.engine.quant.calibrate import GPTQ_TOKENS  # noqa: E402
from edgeinfer.engine.tokenizer import Tokenizer  # noqa: E402
from edgeinfer.eval.harness import EvalSettings, eval_tokens  # noqa: E402
from edgeinfer.eval.scoring import Candidate, compare  # noqa: E402

CALIBRATION = "enwiki"
# label → (llama-quantize type, with the importance matrix, format)
PEER_ROWS = {
    "llama.cpp Q4_1": ("Q4_1", False, "groups of 32, fp16 scale and min (5.0 bits a weight)"),
    "llama.cpp Q4_1 + imatrix": ("Q4_1", True, "the same, rounding weighted by the importance matrix"),
    "llama.cpp Q4_0": ("Q4_0", False, "groups of 32, fp16 scale (4.5 bits)"),
}
OURS = "edgeinfer int4, GPTQ"
OURS_FORMAT = "groups of 32, bf16 scale and zero point (5.0 bits)"
FLAGS = ("--pure", "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0")


def calibration_file(tokenizer: Tokenizer, tokens: int) -> Path:
    """The calibration text's leading documents, at least `tokens` Gemma tokens, as a file llama.cpp reads."""
    dst = peers.PEERS_DIR / "models" / f"{CALIBRATION}-{tokens}.txt"
    if not dst.exists():
        docs, count = [], 0
        for doc in load_text(CALIBRATION).documents:
            docs.append(doc)
            count += len(tokenizer.encode(doc + "\n", add_special_tokens=False))
            if count >= tokens:
                break
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_text("\n".join(docs) + "\n", encoding="utf-8")
    return dst


def peer_files(bf16: Path, tokenizer: Tokenizer, threads: int) -> dict[str, Path]:
    models = peers.PEERS_DIR / "models"
    imatrix = models / f"{bf16.stem}.imatrix-{CALIBRATION}-{GPTQ_TOKENS}.gguf"
    files = {}
    for label, (qtype, weighted, _) in PEER_ROWS.items():
        flags = FLAGS
        if weighted:
            if not imatrix.exists():
                text = calibration_file(tokenizer, GPTQ_TOKENS + 4096)  # llama.cpp reads 64 whole chunks
                peers.importance_matrix(bf16, text, imatrix, GPTQ_TOKENS, threads)
            flags = (*FLAGS, "--imatrix", str(imatrix))
        dst = models / f"{bf16.stem}.pure-{qtype}{f'-imatrix-{GPTQ_TOKENS}' if weighted else ''}.gguf"
        files[label] = dst if dst.exists() else peers.quantize(bf16, dst, qtype, flags)
    return files


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--stride", type=int, default=None, help="tokens between windows (default window/2)")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    peers.build()
    settings = EvalSettings(tokens=args.tokens, stride=args.stride)
    baseline = LLMEngine(settings.baseline)
    bf16 = peers.peer_gguf("bf16", resolve_default_model())
    files = peer_files(bf16, baseline.tokenizer, args.threads)
    candidates = [
        Candidate.from_engine(label, LLMEngine(replace(settings.baseline, model=str(f))))
        for label, f in files.items()
    ]
    ours = EngineConfig(quantization="int4", gptq_calibration=CALIBRATION)
    candidates.append(Candidate.from_engine(OURS, LLMEngine(ours)))
    ids = eval_tokens(load_text(settings.text), baseline.tokenizer, settings.tokens)
    result = compare(
        Candidate.from_engine("baseline", baseline),
        candidates,
        ids,
        baseline.tokenizer.bos_token_id,
        settings.window,
        settings.effective_stride,
    )
    formats = {label: row[2] for label, row in PEER_ROWS.items()} | {OURS: OURS_FORMAT}
    print(
        f"baseline perplexity {result.reference_perplexity:.3f} over {len(ids)} tokens, windows of "
        f"{settings.window}, stride {settings.effective_stride}; calibration: {GPTQ_TOKENS} tokens of "
        f"{CALIBRATION}"
    )
    print("| model | format | perplexity | KL mean | top-1 agreement |")
    print("|---|---|---|---|---|")
    for name, c in result.comparisons().items():
        change = f"{c.perplexity:.3f} ({c.ppl_change:+.1%} ± {c.ppl_change_ci95:.1%})"
        print(f"| {name} | {formats[name]} | {change} | {c.kl_mean:.3f} | {c.top1_agreement:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
