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


@pytest.mark.parametrize("family", ["qwen3_moe", "glm4_moe", "deepseek_v3"])
def test_generate_prints_the_engines_greedy_completion(family, moe_models):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [EDGEINFER, "generate", "--model", moe_models[family], "--prompt", PROMPT, "--max-tokens", "12"]
    run = subprocess.run([*cmd, "--dtype", "float32"], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr
    eng = LLMEngine(EngineConfig(model=moe_models[family], dtype="float32", batch_window_ms=0))
    (expected,) = eng.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0))
    assert expected.text.strip()
    assert run.stdout == expected.text + "\n"
