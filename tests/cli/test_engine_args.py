"""The engine flags are declared once (cli/engine_args.py): `serve`, `generate` and `eval` accept the same
ones and build the same `EngineConfig` from them; a wrong name is one line on stderr."""

from __future__ import annotations

import dataclasses

import pytest

from edgeinfer.cli import build_parser, main
from edgeinfer.cli.engine_args import engine_config
from edgeinfer.engine.config import EngineConfig
from edgeinfer.eval import cli as eval_cli

# Every flag away from its default (calibration off and GPTQ cannot go together: two sets).
FLAGS = [
    "--device", "cuda", "--dtype", "float16", "--quantization", "int4", "--lm-head-quantization", "none",
    "--gptq", "enwiki", "--no-cpu-gemv", "--kv-cache-dtype", "int8", "--kv-cache-memory", "64MiB",
    "--no-hybrid-kv-cache", "--weights", "bf16",
    "--max-model-len", "256", "--max-num-seqs", "3", "--max-num-batched-tokens", "96",
    "--max-step-ms", "0", "--shared-step-ms", "40", "--batch-step-ms", "0",
    "--batch-window-ms", "0", "--scheduling-policy", "priority",
    "--no-prefix-caching", "--no-tenant-shares", "--attention-backend", "torch",
    "--mla-mode", "expand", "--compile", "--no-prepared-cache", "--cache-dir", "/tmp/edgeinfer-cache",
    "--threads", "3", "--speculative-method", "draft", "--num-speculative-tokens", "7", "--ngram-min", "1",
    "--ngram-max", "5", "--speculative-max-batch", "2", "--draft-model", "/tmp/draft",
    "--draft-vocab-size", "512",
]  # fmt: skip
EXPECTED = EngineConfig(
    device="cuda",
    dtype="float16",
    quantization="int4",
    lm_head_quantization="none",
    gptq_calibration="enwiki",
    cpu_gemv=False,
    kv_cache_dtype="int8",
    kv_cache_memory_bytes=64 * 2**20,
    hybrid_kv_cache=False,
    weights="bf16",
    max_model_len=256,
    max_num_seqs=3,
    max_num_batched_tokens=96,
    max_step_ms=None,
    shared_step_ms=40.0,
    batch_step_ms=None,
    batch_window_ms=0,
    scheduling_policy="priority",
    enable_prefix_caching=False,
    cache_tenant_shares=False,
    fair_share=False,
    attention_backend="torch",
    mla_mode="expand",
    compile=True,
    prepared_cache=False,
    cache_dir="/tmp/edgeinfer-cache",
    speculative_method="draft",
    num_speculative_tokens=7,
    ngram_min=1,
    ngram_max=5,
    speculative_max_batch=2,
    draft_model="/tmp/draft",
    draft_vocab_size=512,
)
UNCALIBRATED = ["--quantization", "int8", "--no-calibrate"]
# Fields no engine flag sets: the model (serve names a pool of them), the KV layout and pool size (tests and
# benchmarks), and the public prefixes (serve's --public-prefixes file, per model).
NOT_FLAGS = {
    "model",
    "block_size",
    "num_kv_blocks",
    "public_prefixes",
    "public_system_prompts",
    "attention_backend",  # one backend so far: no value differs from the default
}


def _config(command: str, flags: list[str]) -> EngineConfig:
    argv = [command, *(["--prompt", "x"] if command == "generate" else []), *flags]
    args = build_parser(argv).parse_args(argv)
    if command == "eval":
        return eval_cli.settings(args).engine
    return engine_config(args, args.model) if command == "generate" else engine_config(args)


@pytest.mark.parametrize("command", ["serve", "generate", "eval"])
def test_every_engine_command_builds_the_same_config_from_the_same_flags(command: str) -> None:
    assert _config(command, FLAGS) == EXPECTED
    assert _config(command, UNCALIBRATED) == EngineConfig(quantization="int8", calibrate_quantization=False)
    assert _config(command, []) == EngineConfig()  # the defaults are EngineConfig's


@pytest.mark.parametrize("command", ["serve", "generate", "eval"])
def test_threads_is_the_runtimes_flag_in_every_engine_command(command: str) -> None:
    """`--threads` is process-wide: it starts the runtime (engine/runtime.py), no engine's config."""
    argv = [command, *(["--prompt", "x"] if command == "generate" else []), "--threads", "3"]
    assert build_parser(argv).parse_args(argv).threads == 3


def _changed(config: EngineConfig) -> set[str]:
    default = EngineConfig()
    return {f.name for f in dataclasses.fields(config) if getattr(config, f.name) != getattr(default, f.name)}


def test_the_flags_cover_every_engine_setting() -> None:
    """A new EngineConfig field needs a flag in cli/engine_args.py (or a reason in NOT_FLAGS)."""
    by_flags = _changed(EXPECTED) | _changed(_config("generate", UNCALIBRATED))
    assert by_flags | NOT_FLAGS == {f.name for f in dataclasses.fields(EngineConfig)}


def test_the_old_spellings_still_parse() -> None:
    """`eval`'s `--quantization none` and `serve`'s off-switches keep working."""
    assert _config("eval", ["--quantization", "none"]).quantization is None
    config = _config("serve", ["--no-calibrate", "--no-prefix-caching", "--no-prepared-cache"])
    assert not (config.calibrate_quantization or config.enable_prefix_caching or config.prepared_cache)


@pytest.mark.parametrize("command", ["serve", "generate", "eval"])
def test_an_unknown_attention_backend_is_one_line_naming_the_known_ones(command: str, capsys) -> None:
    argv = [command, *(["--prompt", "x"] if command == "generate" else []), "--attention-backend", "flash"]
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"edgeinfer {command}: error: argument --attention-backend: invalid choice")
    assert "'flash'" in line and line.endswith(("(choose from torch)", "(choose from 'torch')"))
    with pytest.raises(ValueError, match=r"^unknown attention backend 'flash' \(known: torch\)$"):
        EngineConfig(attention_backend="flash")


def test_a_bad_kv_cache_size_is_a_one_line_error(capsys) -> None:
    assert main(["serve", "--kv-cache-memory", "lots"]) == 2
    assert capsys.readouterr().err.startswith("edgeinfer serve: error: cannot read memory size 'lots'")
