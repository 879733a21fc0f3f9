"""MoE serving: edgeinfer vs llama.cpp's llama-server on a GLM-4.5-shaped and a DeepSeek-V3-shaped model.

    python bench/moe_vs_llamacpp.py                       # both models, bf16 and int4, C = 1, 8, 32
    python bench/moe_vs_llamacpp.py --models glm45 --precision bf16 --concurrency 1 8 \
        --prompts-per-slot 1 --min-prompts 4 --no-docs    # a quick look
    python bench/moe_vs_llamacpp.py --build-only          # the checkpoints and GGUFs only

Everything is built offline and cached under bench/.peers/moe/ (gitignored), once:

- a byte-level BPE tokenizer (~32k tokens) trained with the `tokenizers` library on the texts `edgeinfer eval`
  ships with (gensim's Lee news corpus and Wikipedia extract), the benchmark's prompt words and Python's own
  standard-library source, pre-tokenized with the regex of llama.cpp's pre-tokenizer for the architecture
  (`glm4` for GLM-4.5, `deepseek-v3` for DeepSeek-V3, copied from src/llama-vocab.cpp), with the special
  tokens the converter looks up;
- the model: transformers' config class, `AutoModelForCausalLM.from_config` (random weights, seed 0), saved
  with `save_pretrained` in bf16;
- its GGUF: BF16 by the converter vendored with llama.cpp (convert_hf_to_gguf.py, with its own gguf-py), and
  Q4_K_M from that by llama-quantize.

The converter names a BPE pre-tokenizer by the sha256 of the token ids it gets for a fixed test string, from a
table that convert_hf_to_gguf_update.py generates from the released tokenizers; a newly trained vocabulary
gives a new hash, so the converter refuses it. The script registers the hash of its own tokenizer under the
pre-tokenizer it was built with, as the update script would, by wrapping the converter's get_vocab_base_pre
in the converter's process (llama.cpp's files are not edited): any other unknown hash still fails.

The servers run one at a time on 127.0.0.1, each with its own default thread count unless `--threads` is
given: `edgeinfer serve` (bf16, and `--quantization int4`) from the HF directory, llama-server on the BF16
and on the Q4_K_M GGUF (`-np max(C)`, continuous batching, flash attention on). Each server is started twice:
the first start (ours with an empty `--cache-dir`, so it prepares the model and fills the prepared-form
cache; llama-server's reads its GGUF into the page cache), then the timed second start: process start to
ready (`/ready` or `/health`), and to the first answered request (8 greedy tokens). Peak RSS at load is
VmHWM of /proc/<pid>/status right after that request. The benchmark then runs on the same process:
streamed random prompts of 128 tokens and 128 output tokens (ignore_eos), C in flight, max(min-prompts,
prompts-per-slot × C) requests per level, prompts seeded by C (bench/serve_vs_llamacpp.py's levels).
Results: bench/results/moe_vs_llamacpp-MODEL-CPU.json (each precision run replaces its own entry) and a
section per model in docs/benchmarks.md (moe-serve-MODEL-CPU), unless `--no-docs`.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from hashlib import sha256
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO / "src"), str(REPO / "bench")]  # run as a script without installing the package

import peers  # noqa: E402
import serve_report  # noqa: E402
from docs_table import replace_section  # noqa: E402
from serve_vs_llamacpp import Workload, _refuse_fallback, bench_level, llama_version  # noqa: E402

from edgeinfer.bench.cli import discover_model  # noqa: E402
from edgeinfer.bench.datasets import WORDS  # noqa: E402
from edgeinfer.bench.metrics import Distribution, Summary  # noqa: E402
from edgeinfer.bench.process import ServerProcess, start_server  # noqa: E402

DOCS = REPO / "docs" / "benchmarks.md"
RESULTS = REPO / "bench" / "results"
WORK = peers.PEERS_DIR / "moe"
CPU = peers.cpu_family()
VOCAB_SIZE = 32000

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), in the form of the released tokenizer.json files:
# GLM-4.5 splits with one regex (its `(?i:...)` is what llama.cpp spells out letter by letter), DeepSeek-V3
# with three in sequence. Both then map bytes to unicode (ByteLevel without its own regex).
GLM4_SPLITS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+",
)
DEEPSEEK3_SPLITS = (
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)


@dataclass(frozen=True)
class TokenizerSpec:
    pre: str  # llama.cpp's name for the pre-tokenizer (tokenizer.ggml.pre)
    splits: tuple[str, ...]
    specials: tuple[str, ...]  # appended after the trained vocabulary, as the released models do
    bos: str | None  # added in front of every text (DeepSeek-V3's add_bos_token), None: nothing added
    eos: str
    ignore_merges: bool  # llama.cpp sets it for glm4: a word found whole in the vocabulary is one token


GLM4_TOKENIZER = TokenizerSpec(
    pre="glm4",
    splits=GLM4_SPLITS,
    # The ones Glm4MoeModel.set_vocab looks up ([gMASK], <|user|>, <|endoftext|>, <|observation|>) and the
    # rest of GLM-4.5's chat markers.
    specials=(
        "<|endoftext|>",
        "[MASK]",
        "[gMASK]",
        "[sMASK]",
        "<sop>",
        "<eop>",
        "<|system|>",
        "<|user|>",
        "<|assistant|>",
        "<|observation|>",
    ),
    bos=None,
    eos="<|endoftext|>",
    ignore_merges=True,
)
DEEPSEEK3_TOKENIZER = TokenizerSpec(
    pre="deepseek-v3",
    splits=DEEPSEEK3_SPLITS,
    specials=(
        "<｜begin▁of▁sentence｜>",
        "<｜end▁of▁sentence｜>",
        "<｜▁pad▁｜>",
        "<｜User｜>",
        "<｜Assistant｜>",
    ),
    bos="<｜begin▁of▁sentence｜>",
    eos="<｜end▁of▁sentence｜>",
    ignore_merges=False,
)


@dataclass(frozen=True)
class ModelSpec:
    title: str
    config_class: str  # in transformers
    tokenizer: TokenizerSpec
    config: dict[str, Any] = field(default_factory=dict)


# Scaled-down shapes of the released models (GLM-4.5: hidden 5120, 160 experts top-8 of width 1536, 1 shared,
# first 3 layers dense; DeepSeek-V3: hidden 7168, 256 experts top-8 of 2048 in 8 groups of which 4 are
# used, q_lora 1536, kv_lora 512, rope dims 64, first 3 dense). Both: hidden 1024, 12 layers, the first dense
# (width 4096), 32 routed experts top-4 of width 512 plus one shared, ~0.7B parameters, bf16, no MTP layer.
_COMMON: dict[str, Any] = dict(
    hidden_size=1024,
    intermediate_size=4096,
    num_hidden_layers=12,
    num_attention_heads=16,
    n_routed_experts=32,
    num_experts_per_tok=4,
    moe_intermediate_size=512,
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    max_position_embeddings=4096,
    num_nextn_predict_layers=0,
    tie_word_embeddings=False,
)
MODELS: dict[str, ModelSpec] = {
    "glm45": ModelSpec(
        title="GLM-4.5 shape",
        config_class="Glm4MoeConfig",
        tokenizer=GLM4_TOKENIZER,
        config=dict(
            _COMMON,
            num_key_value_heads=4,
            head_dim=64,
            partial_rotary_factor=0.5,
            use_qk_norm=True,
            attention_bias=True,
            n_group=1,
            topk_group=1,
        ),
    ),
    "deepseek": ModelSpec(
        title="DeepSeek-V3 shape (MLA)",
        config_class="DeepseekV3Config",
        tokenizer=DEEPSEEK3_TOKENIZER,
        config=dict(
            _COMMON,
            num_key_value_heads=16,
            q_lora_rank=512,
            kv_lora_rank=512,
            qk_nope_head_dim=64,
            qk_rope_head_dim=64,
            v_head_dim=64,
            n_group=4,
            topk_group=2,
            rope_interleave=True,
            # as DeepSeek-V3's config.json has them: the converter writes sigmoid gating from the first
            # (without it llama.cpp's deepseek2 falls back to softmax gating)
            scoring_func="sigmoid",
            topk_method="noaux_tc",
        ),
    ),
}
# Our engine's flags and llama-server's file for each precision class.
OUR_ARGS = {"bf16": [], "int4": ["--quantization", "int4"]}
PEER_TYPE = {"bf16": "BF16", "int4": "Q4_K_M"}
FIRST_REQUEST = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0.0}


# ---------------------------------------------------------------------------------------------- building


def training_text() -> Iterator[str]:
    """Offline English prose, the prompt words and Python source, a few MB in all."""
    from edgeinfer.corpus import load_text

    for name in ("lee", "enwiki"):
        yield from load_text(name).documents
    yield from (" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS)))
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        yield path.read_text(encoding="utf-8", errors="replace")


def build_tokenizer(spec: TokenizerSpec, out: Path) -> None:
    """Train a byte-level BPE with `spec`'s pre-tokenizer and write it as a transformers tokenizer."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(ignore_merges=spec.ignore_merges))
    splits = [pre_tokenizers.Split(Regex(p), behavior="isolated") for p in spec.splits]
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(spec.specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer)
    tok.add_special_tokens(list(spec.specials))
    if spec.bos is not None:
        bos = (spec.bos, tok.token_to_id(spec.bos))
        tok.post_processor = processors.TemplateProcessing(
            single=f"{spec.bos} $A", pair=f"{spec.bos} $A $B:1", special_tokens=[bos]
        )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=spec.eos, bos_token=spec.bos,
                                   pad_token=spec.eos, add_bos_token=spec.bos is not None)  # fmt: skip
    fast.save_pretrained(out)


def build_checkpoint(name: str, out: Path) -> int:
    """The random bf16 checkpoint and its tokenizer in `out` (cached); returns the parameter count."""
    import torch
    import transformers

    marker = out / "built.json"
    if marker.exists():
        return json.loads(marker.read_text())["parameters"]
    spec = MODELS[name]
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    started = time.monotonic()
    build_tokenizer(spec.tokenizer, out)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in (spec.tokenizer.eos, spec.tokenizer.bos) if t}
    config = getattr(transformers, spec.config_class)(
        vocab_size=len(tokenizer),
        eos_token_id=ids[spec.tokenizer.eos],
        bos_token_id=ids.get(spec.tokenizer.bos or ""),
        pad_token_id=ids[spec.tokenizer.eos],
        **spec.config,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    parameters = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    marker.write_text(json.dumps({"parameters": parameters, "seconds": time.monotonic() - started}))
    print(f"{name}: {parameters / 1e6:.0f}M parameters written to {out}", file=sys.stderr)
    return parameters


def llama_cpp_dir() -> Path:
    """The llama.cpp sources peers.build() unpacked (convert_hf_to_gguf.py, gguf-py, conversion/)."""
    return (
        peers.PEERS_DIR
        / "src"
        / f"llama_cpp_python-{peers.LLAMA_CPP_PYTHON_VERSION}"
        / "vendor"
        / "llama.cpp"
    )


def converter_test_text(llama_dir: Path) -> str:
    """The string whose token ids the converter hashes (`chktxt` of get_vocab_base_pre), from its source."""
    tree = ast.parse((llama_dir / "conversion" / "base.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "get_vocab_base_pre":
            for stmt in ast.walk(node):
                if isinstance(stmt, ast.Assign) and getattr(stmt.targets[0], "id", None) == "chktxt":
                    return ast.literal_eval(stmt.value)
    raise RuntimeError("get_vocab_base_pre has no chktxt: the converter changed, update this script")


def tokenizer_hash(hf_dir: Path, llama_dir: Path) -> str:
    """The converter's chkhsh of the tokenizer in `hf_dir`: sha256 of the ids of its test string."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(hf_dir).encode(converter_test_text(llama_dir))
    return sha256(str(ids).encode()).hexdigest()


# Run in the converter's own process (with its own gguf-py first on the path): registers one tokenizer hash
# under a pre-tokenizer name, the entry convert_hf_to_gguf_update.py would generate, then runs the converter.
_CONVERT_SHIM = """
import runpy, sys
from hashlib import sha256
llama_dir, chkhsh, pre, chktxt = sys.argv[1:5]
sys.argv = [llama_dir + "/convert_hf_to_gguf.py", *sys.argv[5:]]
sys.path[:0] = [llama_dir, llama_dir + "/gguf-py"]
from conversion import base
known = base.TextModel.get_vocab_base_pre
def get_vocab_base_pre(self, tokenizer):
    if sha256(str(tokenizer.encode(chktxt)).encode()).hexdigest() == chkhsh:
        print(f"chkhsh {chkhsh} registered as {pre!r}", file=sys.stderr)
        return pre
    return known(self, tokenizer)
base.TextModel.get_vocab_base_pre = get_vocab_base_pre
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(name: str, hf_dir: Path, dst: Path) -> Path:
    """HF directory → BF16 GGUF with llama.cpp's converter (cached)."""
    if dst.exists():
        return dst
    llama_dir = llama_cpp_dir()
    chkhsh = tokenizer_hash(hf_dir, llama_dir)
    tmp = dst.with_suffix(".partial")
    shim = [sys.executable, "-c", _CONVERT_SHIM, str(llama_dir), chkhsh, MODELS[name].tokenizer.pre]
    argv = [*shim, converter_test_text(llama_dir), str(hf_dir), "--outfile", str(tmp), "--outtype", "bf16"]
    log = WORK / "logs" / f"convert-{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        if subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=_converter_env()).returncode:
            raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}: see {log}\n{_tail(log)}")
    tmp.replace(dst)
    return dst


def _converter_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop(
        "PYTHONPATH", None
    )  # the converter's gguf-py, not the installed gguf package, is the one it was written for
    return env


def _tail(path: Path, chars: int = 1500) -> str:
    return path.read_text(errors="replace")[-chars:]


@dataclass(frozen=True)
class Artifacts:
    hf_dir: Path
    parameters: int
    ggufs: dict[str, Path]  # precision → the GGUF llama-server loads


def prepare(name: str, precisions: list[str]) -> Artifacts:
    hf_dir = WORK / name / "hf"
    parameters = build_checkpoint(name, hf_dir)
    bf16 = convert(name, hf_dir, WORK / name / f"{name}.BF16.gguf")
    ggufs = {"bf16": bf16}
    if "int4" in precisions:
        q4 = WORK / name / f"{name}.Q4_K_M.gguf"
        ggufs["int4"] = q4 if q4.exists() else peers.quantize(bf16, q4, "Q4_K_M")
    return Artifacts(hf_dir, parameters, ggufs)


# ---------------------------------------------------------------------------------------------- measuring


@dataclass
class Start:
    ready_s: float
    answered_s: float
    peak_rss_mib: float


def peak_rss_mib(pid: int) -> float:
    """VmHWM (the process's peak resident set) from /proc, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM in /proc/{pid}/status")


@contextlib.contextmanager
def timed_server(
    argv: list[str], port: int, health: str, log: Path, timeout_s: float, env: dict[str, str] | None = None,
    poll_s: float = 0.02,
) -> Iterator[tuple[ServerProcess, Start]]:  # fmt: skip
    """Start `argv`; time it to `health` answering 200 (asked every `poll_s`) and to one answered
    completion; VmHWM after that."""
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    server = start_server(argv, url, log, health, timeout_s, env, poll_s=poll_s)
    try:
        ready = time.perf_counter() - t0
        model = discover_model(url, None)
        with httpx.Client(timeout=timeout_s) as client:
            client.post(url + "/v1/completions", json={"model": model, **FIRST_REQUEST}).raise_for_status()
        answered = time.perf_counter() - t0
        yield server, Start(ready, answered, peak_rss_mib(server.process.pid))
    finally:
        server.stop()


def our_argv(
    name: str, hf_dir: Path, precision: str, port: int, threads: int | None, cache: Path
) -> list[str]:
    argv = [sys.executable, "-m", "edgeinfer.cli", "serve", "--model", f"{name}={hf_dir}", "--preload", name,
            "--host", "127.0.0.1", "--port", str(port), "--no-access-log", "--usage-db",
            str(RESULTS / "usage.sqlite"), "--cache-dir", str(cache), *OUR_ARGS[precision]]  # fmt: skip
    return argv + (["--threads", str(threads)] if threads else [])


def peer_argv(gguf: Path, port: int, n_parallel: int, ctx: int, threads: int | None) -> list[str]:
    """peers.llama_server_argv, without its thread flags unless `threads` is given (llama-server's own)."""
    argv = peers.llama_server_argv(gguf, port, n_parallel, ctx, threads or 1)
    if threads:
        return argv
    drop = {i for i, a in enumerate(argv) if a in ("--threads", "--threads-batch")}
    return [a for i, a in enumerate(argv) if i not in drop and i - 1 not in drop]


def tokenizer_agreement(server: ServerProcess, hf_dir: Path) -> dict[str, Any]:
    """Whether llama-server's tokenizer (the GGUF's vocabulary and pre-tokenizer) gives the ids the HF
    tokenizer gives, on a benchmark prompt and on the converter's test string (digits, CJK, emoji, runs of
    whitespace)."""
    from transformers import AutoTokenizer

    from edgeinfer.bench.datasets import random_dataset

    hf = AutoTokenizer.from_pretrained(hf_dir)
    prompt = random_dataset(1, (64, 64), (1, 1), 0)[0].turns[0].text
    texts = [
        prompt,
        converter_test_text(llama_cpp_dir()),
        "Hello, world! It's 2024-06-01; x=3.14 (approx.)\n\n\tok",
    ]
    agree = 0
    for text in texts:
        reply = httpx.post(
            server.base_url + "/tokenize", json={"content": text, "add_special": True}, timeout=60
        )
        agree += reply.json()["tokens"] == hf.encode(text)
    return {"texts": len(texts), "agree": agree}


def run_server(
    label: str, argv: list[str], port: int, health: str, log: Path, args: argparse.Namespace,
    env: dict[str, str] | None = None, hf_dir: Path | None = None,
) -> dict[str, Any]:  # fmt: skip
    """First start (discarded but for its time), the timed second start, then the benchmark levels."""
    print(f"{label}: {shlex.join(argv)}", file=sys.stderr)
    with timed_server(argv, port, health, log, args.start_timeout, env) as (_, first):
        pass
    print(f"  first start: ready {first.ready_s:.1f} s, answered {first.answered_s:.1f} s", file=sys.stderr)
    work = Workload(args.input_len, args.output_len, args.prompts_per_slot, args.min_prompts, args.seed)
    with timed_server(argv, port, health, log, args.start_timeout, env) as (server, second):
        print(f"  second start: ready {second.ready_s:.2f} s, answered {second.answered_s:.2f} s, "
              f"VmHWM {second.peak_rss_mib:.0f} MiB", file=sys.stderr)  # fmt: skip
        if health == "/ready":
            _refuse_fallback(log)
        checks = tokenizer_agreement(server, hf_dir) if hf_dir else None
        if checks:
            print(f"  tokenizer: llama-server and HF agree on {checks['agree']}/{checks['texts']} texts",
                  file=sys.stderr)  # fmt: skip
        levels = {
            c: bench_level(server, work, work.num_prompts(c), work.seed + c, c) for c in args.concurrency
        }
    return {
        "argv": argv,
        "first": first.__dict__,
        "second": second.__dict__,
        "levels": {str(c): s.to_dict() for c, s in levels.items()},
        **({"tokenizer": checks} if checks else {}),
    }


def measure(name: str, art: Artifacts, precision: str, args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()[0]
    entry: dict[str, Any] = {}
    if not args.skip_llama:
        gguf = art.ggufs[precision]
        argv = peer_argv(gguf, args.port, max(args.concurrency), args.ctx, args.threads)
        log = WORK / "logs" / f"llama-server-{name}-{precision}.log"
        entry["llama.cpp"] = run_server(
            f"llama-server {gguf.name}", argv, args.port, "/health", log, args, hf_dir=art.hf_dir
        )
        entry["llama.cpp"]["file"] = gguf.name
    if not args.skip_ours:
        cache = WORK / "edgeinfer-cache" / f"{name}-{precision}"
        shutil.rmtree(cache, ignore_errors=True)  # the first start prepares, the second finds it cached
        argv = our_argv(name, art.hf_dir, precision, args.port + 1, args.threads, cache)
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        }
        log = RESULTS / "logs" / f"moe-edgeinfer-{name}-{precision}.log"
        entry["edgeinfer"] = run_server("edgeinfer", argv, args.port + 1, "/ready", log, args, env)
    entry.update(
        load=[load_before, os.getloadavg()[0]],
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        command=f"python bench/moe_vs_llamacpp.py {shlex.join(sys.argv[1:])}",
        workload=dict(
            input_len=args.input_len,
            output_len=args.output_len,
            min_prompts=args.min_prompts,
            prompts_per_slot=args.prompts_per_slot,
        ),
        threads=args.threads,
    )
    return entry


# ---------------------------------------------------------------------------------------------- reporting


def _summary(d: dict[str, Any]) -> Summary:
    """A Summary back from its JSON form."""
    dists = {k: Distribution(**d[k]) for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")}
    return Summary(**{**d, **dists})


def _f(x: float, digits: int = 1) -> str:
    return "n/a" if x != x else f"{x:.{digits}f}"


def _ratio(ours: float, peer: float) -> str:
    return "n/a" if not peer or ours != ours or peer != peer else f"{ours / peer:.2f}×"


def serving_table(stored: dict[str, Any]) -> str:
    rows = [
        "| class | C | llama.cpp out tok/s | edgeinfer out tok/s | ratio | llama.cpp TPOT p50 ms | "
        "edgeinfer TPOT p50 ms | ratio | llama.cpp TTFT p50 ms | edgeinfer TTFT p50 ms | ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for precision in OUR_ARGS:
        if precision not in stored:
            continue
        entry = stored[precision]
        peer, ours = (
            entry.get("llama.cpp", {}).get("levels", {}),
            entry.get("edgeinfer", {}).get("levels", {}),
        )
        for c in sorted({*peer, *ours}, key=int):
            p = _summary(peer[c]) if c in peer else None
            o = _summary(ours[c]) if c in ours else None
            nan = float("nan")
            pv = (p.output_throughput, p.tpot_ms.median, p.ttft_ms.median) if p else (nan, nan, nan)
            ov = (o.output_throughput, o.tpot_ms.median, o.ttft_ms.median) if o else (nan, nan, nan)
            failed = [f"{s.failed} failed" for s in (p, o) if s and s.failed]
            cells = [f"{_f(a)} | {_f(b)} | {_ratio(b, a)}" for a, b in zip(pv, ov, strict=True)]
            note = f" ({', '.join(failed)})" if failed else ""
            rows.append(f"| {precision} | {c}{note} | {' | '.join(cells)} |")
    return "\n".join(rows)


def start_table(stored: dict[str, Any]) -> str:
    rows = [
        "| class | server | first start: answered s | second start: ready / answered s | "
        "peak RSS at load (VmHWM) MiB | measured | load avg before → after |",
        "|---|---|---|---|---|---|---|",
    ]
    for precision in OUR_ARGS:
        entry = stored.get(precision)
        if not entry:
            continue
        for label in ("llama.cpp", "edgeinfer"):
            if label not in entry:
                continue
            run, second = entry[label], entry[label]["second"]
            what = (
                f"`{run['file']}`"
                if label == "llama.cpp"
                else f"`{shlex.join(['serve', *OUR_ARGS[precision]])}`"
            )
            rows.append(
                f"| {precision} | {label} {what} | {run['first']['answered_s']:.1f} | "
                f"{second['ready_s']:.2f} / {second['answered_s']:.2f} | {second['peak_rss_mib']:.0f} | "
                f"{entry['date']} | {entry['load'][0]:.1f} → {entry['load'][1]:.1f} |"
            )
        if "llama.cpp" in entry and "edgeinfer" in entry:
            o, p = entry["edgeinfer"]["second"], entry["llama.cpp"]["second"]
            ready, answered, rss = (_ratio(o[k], p[k]) for k in ("ready_s", "answered_s", "peak_rss_mib"))
            rows.append(f"| {precision} | ratio edgeinfer / llama.cpp | | {ready} / {answered} | {rss} | | |")
    return "\n".join(rows)


def describe(name: str, parameters: int, stored: dict[str, Any]) -> str:
    spec = MODELS[name]
    shape = ", ".join(f"{k} {v}" for k, v in spec.config.items() if k not in ("tie_word_embeddings",))
    entries = [stored[p] for p in OUR_ARGS if p in stored]
    threads = {e.get("threads") for e in entries}
    thread_text = ("each server's default thread count" if threads == {None}
                   else f"threads {', '.join(str(t) for t in sorted(threads, key=str))}")  # fmt: skip
    work = entries[-1]["workload"]
    levels = [
        s
        for e in entries
        for run in e.values()
        if isinstance(run, dict)
        for s in run.get("levels", {}).values()
    ]
    done = sum(s["completed"] for s in levels)
    mean_in = sum(s["total_input_tokens"] for s in levels) / done if done else float("nan")
    commands = sorted({e["command"] for e in entries})
    return "\n".join([
        f"### MoE serving, {spec.title}: edgeinfer vs llama.cpp, {CPU} CPU",
        "",
        f"Machine: {serve_report.machine_info()}; {thread_text}; one server at a time. The machine is shared "
        "with other work (1-min load averages per run below), so absolute numbers are noisy.",
        f"Model: random weights, {parameters / 1e6:.0f}M parameters, bf16, `{spec.config_class}` ({shape}); "
        f"a {VOCAB_SIZE // 1000}k byte-level BPE trained here with llama.cpp's `{spec.tokenizer.pre}` "
        "pre-tokenizer. Built offline by the script (bench/.peers/moe/).",
        f"llama.cpp: llama-server {llama_version()} (llama-cpp-python {peers.LLAMA_CPP_PYTHON_VERSION}) on "
        "the BF16 GGUF from its convert_hf_to_gguf.py and the Q4_K_M llama-quantize makes of it; "
        "`-np max(C)`, continuous batching, flash attention on. edgeinfer: `edgeinfer serve` on the HF "
        "directory (bf16), with `--quantization int4` for the int4 class.",
        f"Workload: streamed random prompts of {work['input_len']} words ({_f(mean_in)} tokens on average, "
        f"as the servers counted them), {work['output_len']} "
        f"output tokens (ignore_eos), max({work['min_prompts']}, {work['prompts_per_slot']}×C) requests per "
        "level, C in flight. Ratios are edgeinfer / llama.cpp: above 1 is better for tok/s, below 1 for "
        "TPOT, TTFT, start time and memory.",
        "Commands: " + "; ".join(f"`{c}`" for c in commands),
        "",
        serving_table(stored),
        "",
        "Start and memory: each server is started twice; the first start (ours with an empty `--cache-dir`, "
        "preparing the model and filling its prepared-form cache), then the second, timed from process start "
        "to ready (`/ready`, `/health`) and to an answered 8-token request; peak RSS is VmHWM right after "
        "it. Ours on its own: with `edgeinfer standby` running, see the restart table (bench/restart.py).",
        "",
        start_table(stored),
    ])  # fmt: skip


# ---------------------------------------------------------------------------------------------- main


def parse_args() -> argparse.Namespace:
    formatter = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    p.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    p.add_argument("--precision", nargs="+", choices=list(OUR_ARGS), default=list(OUR_ARGS))
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-per-slot", type=int, default=2)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="for both servers (default: each one's own)")
    p.add_argument("--ctx", type=int, default=512, help="llama-server KV tokens per slot")
    p.add_argument("--port", type=int, default=8330, help="llama-server port; ours uses port + 1")
    p.add_argument("--start-timeout", type=float, default=1800.0, help="seconds per server start")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--build-only", action="store_true", help="build the models and GGUFs, measure nothing")
    p.add_argument(
        "--render-only", action="store_true", help="rewrite the docs sections from the stored JSON"
    )
    p.add_argument(
        "--no-docs", dest="write_docs", action="store_false", help="leave docs/benchmarks.md alone"
    )
    return p.parse_args()


def main() -> int:
    args = parse_args()
    # SIGTERM must unwind the server context managers too, or the servers would outlive this script.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    if args.render_only:
        for name in args.models:
            store = RESULTS / f"moe_vs_llamacpp-{name}-{CPU}.json"
            if store.exists():
                built = json.loads((WORK / name / "hf" / "built.json").read_text())
                body = describe(name, built["parameters"], json.loads(store.read_text()))
                print(body)
                if args.write_docs:
                    replace_section(DOCS, f"moe-serve-{name}-{CPU}", body)
        return 0
    peers.build()  # the converter's sources come with it, and llama-quantize
    for name in args.models:
        art = prepare(name, args.precision)
        for precision, gguf in art.ggufs.items():
            print(f"{name} {precision}: {gguf} ({gguf.stat().st_size / 2**20:.0f} MiB)", file=sys.stderr)
        if args.build_only:
            continue
        store = RESULTS / f"moe_vs_llamacpp-{name}-{CPU}.json"
        stored = json.loads(store.read_text()) if store.exists() else {}
        for precision in args.precision:
            stored[precision] = measure(name, art, precision, args)
            store.parent.mkdir(parents=True, exist_ok=True)
            store.write_text(json.dumps(stored, indent=1))
            body = describe(name, art.parameters, stored)
            print(body)
            if args.write_docs:  # after every precision: a long run that is stopped keeps what it measured
                replace_section(DOCS, f"moe-serve-{name}-{CPU}", body)
                print(f"updated {DOCS.relative_to(REPO)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
