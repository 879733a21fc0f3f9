"""llama.cpp's own 4-bit quantizer on our int4 source, scored by our eval harness: how hard is int4 here?

The default model's weights are the Q4_K_M GGUF dequantized (mostly Q5_0, some Q4_K / Q6_K / Q8_0 grids).
This converts that file to BF16 (exact), has llama-quantize write Q4_1 (groups of 32, asymmetric: our
int4's format class) and Q4_0 (groups of 32, symmetric) with every block tensor at that type (`--pure`) and
the token embedding in Q8_0 (as our int4 keeps an int8 lm_head), loads both in our engine and scores them
against the default model on `edgeinfer eval`'s text (2,048 tokens, windows of 512, stride 256):

    python bench/int4_reference.py [--tokens 2048]

It prints one markdown row per file; docs/quantization.md quotes them next to our int4's rows.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "src"))

import peers  # noqa: E402

from edgeinfer.engine.model.loader.default_model import resolve_default_model  # noqa: E402
from edgeinfer.eval.corpus import load_text  # noqa: E402
from edgeinfer.eval.harness import EvalSettings, build_engine, eval_tokens  # noqa: E402
from edgeinfer.eval.scoring import Candidate, compare  # noqa: E402

TYPES = {
    "Q4_1": "groups of 32, fp16 scale and min (5.0 bits a weight)",
    "Q4_0": "groups of 32, fp16 scale (4.5 bits)",
}
FLAGS = ("--pure", "--token-embedding-type", "q8_0", "--output-tensor-type", "q8_0")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    peers.build()
    bf16 = peers.peer_gguf("bf16", resolve_default_model())
    files = {}
    for qtype in TYPES:
        dst = peers.PEERS_DIR / "models" / f"{bf16.stem}.pure-{qtype}.gguf"
        files[qtype] = dst if dst.exists() else peers.quantize(bf16, dst, qtype, FLAGS)
    settings = EvalSettings(tokens=args.tokens)
    baseline = build_engine(settings, None, "auto")
    candidates = [
        Candidate.from_engine(q, build_engine(EvalSettings(model=str(f)), None, "auto"))
        for q, f in files.items()
    ]
    ids = eval_tokens(load_text(settings.text), baseline.tokenizer, settings.tokens)
    bos = baseline.tokenizer.bos_token_id
    result = compare(
        Candidate.from_engine("baseline", baseline),
        candidates,
        ids,
        bos,
        settings.window,
        settings.effective_stride,
    )
    print(f"baseline perplexity {result.reference_perplexity:.3f} over {len(ids)} tokens")
    print("| llama.cpp type | format | perplexity | KL mean | top-1 agreement |")
    print("|---|---|---|---|---|")
    for name, c in result.comparisons().items():
        change = f"{c.perplexity:.3f} ({c.ppl_change:+.1%} ± {c.ppl_change_ci95:.1%})"
        print(f"| {name} | {TYPES[name]} | {change} | {c.kl_mean:.3f} | {c.top1_agreement:.1%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
