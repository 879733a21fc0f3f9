"""`edgeinfer generate` as a user runs it: text alone on stdout; mistakes as one line and exit code 2."""

from __future__ import annotations

import subprocess
import sys


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "edgeinfer.cli", *args], capture_output=True, text=True, timeout=300
    )


def test_prints_only_the_completion(tiny_llama):
    from engine.conftest import make_engine

    from edgeinfer.types import SamplingParams

    res = run(
        "generate",
        "--model",
        tiny_llama,
        "--prompt",
        "Hello, world",
        "--max-tokens",
        "8",
        "--dtype",
        "float32",
    )
    assert res.returncode == 0, res.stderr
    eng = make_engine(tiny_llama)
    (expected,) = eng.generate(["Hello, world"], SamplingParams(max_tokens=8, temperature=0.0))
    assert res.stdout == expected.text + "\n"


def test_bad_arguments_give_one_line_and_exit_2(tiny_llama, tmp_path):
    cases = [
        ("generate", "--model", str(tmp_path / "missing"), "--prompt", "x"),
        ("generate", "--model", tiny_llama, "--prompt", "x", "--max-tokens", "0"),
        ("generate", "--model", tiny_llama, "--prompt", "x", "--temperature", "-1"),
    ]
    for args in cases:
        res = run(*args)
        lines = [line for line in res.stderr.splitlines() if "error" in line]
        assert res.returncode == 2 and res.stdout == "", (args, res.stderr)
        assert len(lines) == 1 and lines[0].startswith("edgeinfer generate: error:"), res.stderr
