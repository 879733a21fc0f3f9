"""`edgeinfer quantize` and `edgeinfer compress` (the top-level CLI finds `quantize_command` /
`compress_command` here, each with `add_arguments(parser)` and `run(args) -> int`)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from types import SimpleNamespace

from edgeinfer.engine.model.loader.conversion import compress_checkpoint, open_source
from edgeinfer.engine.quant.base import QuantizationError, get_weight_method, weight_methods
from edgeinfer.engine.quant.int4 import DEFAULT_GROUP_SIZE, GROUP_SIZES

log = logging.getLogger(__name__)


def _add_io(parser: argparse.ArgumentParser, what: str) -> None:
    parser.add_argument("input", help="HF safetensors directory, .gguf file, or model name (gemma-3-270m)")
    parser.add_argument("output", type=Path, help=f"directory to write the {what} checkpoint to")


def add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    _add_io(parser, "quantized")
    parser.add_argument("--quantization", "-q", required=True, choices=weight_methods(), help="weight method")
    parser.add_argument(
        "--group-size", type=int, default=DEFAULT_GROUP_SIZE, choices=GROUP_SIZES, help="int4 group size"
    )
    parser.add_argument("--quantize-lm-head", action="store_true", help="also quantize an untied lm_head")
    parser.add_argument("--quantize-embeddings", action="store_true", help="also quantize embedding tables")
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="round to nearest only (default: activation-aware scaling and, for int4, grids fitted under "
        "the input energies of a built-in text)",
    )
    parser.add_argument(
        "--gptq",
        default=None,
        metavar="TEXT",
        help="int4: round by GPTQ calibrated on TEXT, enwiki (Wikipedia prose in gensim's test data) "
        "or a UTF-8 file (default: round to nearest after scaling, on the fitted grids)",
    )
    parser.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="PATTERN",
        help="keep modules matching PATTERN unquantized",
    )


def run_quantize(args: argparse.Namespace) -> int:
    from edgeinfer.engine.quant.convert import quantize_checkpoint

    options = {"group_size": args.group_size} if args.quantization == "int4" else {}
    method = get_weight_method(args.quantization, **options)
    _refuse_existing(args.output)
    source = open_source(args.input)
    if args.gptq is not None and (args.no_calibrate or args.quantization != "int4"):
        raise QuantizationError("--gptq is for calibrated int4: not with --no-calibrate or other methods")
    if not args.no_calibrate:
        from edgeinfer.engine.quant.calibrated import calibrated_source

        source = calibrated_source(args.input, source, method, args.skip, args.gptq)
    report = quantize_checkpoint(
        source,
        args.output,
        method,
        skip=args.skip,
        quantize_lm_head=args.quantize_lm_head,
        quantize_embeddings=args.quantize_embeddings,
    )
    print(f"{args.output}: {report.summary()}")
    return 0


def add_compress_arguments(parser: argparse.ArgumentParser) -> None:
    _add_io(parser, "losslessly compressed")
    parser.add_argument("--no-verify", action="store_true", help="skip decoding the output to check it")


def run_compress(args: argparse.Namespace) -> int:
    from edgeinfer.engine.model.loader.codec import open_compressed

    _refuse_existing(args.output)
    stats = compress_checkpoint(open_source(args.input), args.output)
    if not args.no_verify:
        # every tensor is decoded and its sha256 compared with the original's
        checked = sum(1 for _ in open_compressed(args.output))
        log.info("verified %d tensors bit-exact", checked)
    print(f"{args.output}: {stats.summary()}")
    return 0


def _refuse_existing(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise QuantizationError(f"{out} exists and is not empty")


quantize_command = SimpleNamespace(add_arguments=add_quantize_arguments, run=run_quantize)
compress_command = SimpleNamespace(add_arguments=add_compress_arguments, run=run_compress)
