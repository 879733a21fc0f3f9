"""`edgeinfer generate --model DIR` on each MoE architecture, as a user runs it (a real subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.types import SamplingParams

EDGEINFER = str(Path(sys.executable).with_name("edgeinfer"))
PROMPT = "The quick brown fox"


@pytest.mark.parametrize(
    ("family", "flags"),
    [("qwen3_moe", []), ("glm4_moe", []), ("deepseek_v3", []), ("deepseek_v3", ["--mla-mode", "expand"])],
)
def test_generate_prints_the_engines_greedy_completion(family, flags, moe_models):
    """(Both MLA decode modes give the same greedy tokens.)"""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [EDGEINFER, "generate", "--model", moe_models[family], "--prompt", PROMPT, "--max-tokens", "12"]
    run = subprocess.run(
        [*cmd, "--dtype", "float32", *flags], capture_output=True, text=True, env=env, timeout=120
    )
    assert run.returncode == 0, run.stderr
    eng = LLMEngine(EngineConfig(model=moe_models[family], dtype="float32", batch_window_ms=0))
    (expected,) = eng.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0))
    assert expected.text.strip()
    assert run.stdout == expected.text + "\n"


def test_mla_mode_flag_reaches_the_model_of_each_engine(moe_models):
    """`--mla-mode` goes through the shared engine flags to the MLA layers, per engine: one built with
    expand beside one with the default (absorb) in the same process keeps its own mode."""
    from edgeinfer.cli import build_parser
    from edgeinfer.cli.engine_args import engine_config

    def engine(*flags: str) -> LLMEngine:
        argv = ["generate", "--model", moe_models["deepseek_v3"], "--prompt", PROMPT, "--dtype", "float32"]
        args = build_parser(argv).parse_args([*argv, *flags])
        return LLMEngine(engine_config(args, args.model))

    def modes(e: LLMEngine) -> set[str]:
        return {type(layer.self_attn.impl).__name__ for layer in e.model.model.layers}

    expand, absorb = engine("--mla-mode", "expand"), engine()
    assert modes(expand) == {"ExpandLatentAttention"} and modes(absorb) == {"AbsorbLatentAttention"}
