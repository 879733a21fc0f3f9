"""`edgeinfer eval` end to end on a tiny random llama, through the real CLI, plus the scoring path
against transformers and the packaged eval text."""

from __future__ import annotations

import importlib.util
import json
import math
import random

import pytest
import torch
from helpers.tiny_models import make_tiny
from transformers import AutoModelForCausalLM

from edgeinfer.cli import main
from edgeinfer.corpus import load_text
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.engine import LLMEngine
from edgeinfer.eval.harness import DEFAULT_TEXT
from edgeinfer.eval.scoring import Candidate, compare

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "edge",
    "inference",
    "serves",
    "models",
    "close",
    "to",
    "users",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    model = make_tiny("llama", root / "llama")
    rng = random.Random(0)
    text = root / "text.txt"
    text.write_text("\n".join(" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(10)))
    return str(model), str(text)


def _eval(tiny, tmp_path, *extra: str) -> dict:
    model, text = tiny
    out = tmp_path / "report.json"
    argv = [
        "eval",
        "--model",
        model,
        "--text",
        text,
        "--dtype",
        "float32",
        "--tokens",
        "120",
        "--window",
        "48",
    ]
    argv += ["--prefixes", "2", "--prefix-tokens", "8", "--greedy-tokens", "8", "--json", str(out), *extra]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_eval_int8_weights_and_kv_against_the_unquantized_baseline(tiny, tmp_path, capsys):
    report = _eval(tiny, tmp_path, "--quantization", "int8", "--kv-cache-dtype", "int8")
    assert "| perplexity |" in capsys.readouterr().out
    base, test = report["baseline"], report["test"]
    assert report["tokens"] == 120 and report["stride"] == 24
    assert (test["quantization"], test["kv_cache_dtype"]) == ("int8", "int8")
    assert (
        test["weight_bytes"] < base["weight_bytes"]
        and test["kv_bytes_per_token"] < base["kv_bytes_per_token"]
    )
    # A random tiny model is close to uniform over its 384 tokens; int8 moves it a little, not a lot.
    assert 100 < base["perplexity"] < 1000
    assert 0 < test["kl_mean"] < 0.01 and test["kl_max"] >= test["kl_p99"] >= 0
    assert abs(test["ppl_change"]) < 0.01 and 0.5 < test["top1_agreement"] <= 1
    greedy = report["greedy"]
    assert greedy["prompts"] == 2 and all(0 <= n <= 8 for n in greedy["match_lengths"])


def test_eval_of_the_baseline_against_itself_is_exact(tiny, capsys):
    model, text = tiny
    argv = ["eval", "--model", model, "--text", text, "--dtype", "float32", "--tokens", "120"]
    argv += ["--window", "48", "--prefixes", "2", "--prefix-tokens", "8", "--greedy-tokens", "8"]
    assert main([*argv, "--quantization", "none", "--json", "-"]) == 0
    out = capsys.readouterr()
    report = json.loads(out.out)  # with `--json -`, stdout is the JSON alone
    assert "| top-1 agreement |" in out.err
    test = report["test"]
    assert test["kl_mean"] == 0 and test["kl_max"] == 0 and test["top1_agreement"] == 1
    assert test["perplexity"] == report["baseline"]["perplexity"]
    assert report["greedy"]["match_lengths"] == [8, 8]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--window", "8", "--stride", "9"], "stride"),
        (["--kv-cache-dtype", "int3"], "kv_cache_dtype"),
        (["--quantization", "int5"], "int5"),
        (["--text", "/nonexistent/text.txt"], "neither"),
        (["--tokens", "100000"], "asks for more"),
    ],
)
def test_bad_input_is_one_line_error(tiny, args, message, capsys):
    model, text = tiny
    argv = ["eval", "--model", model, "--text", text, "--dtype", "float32", "--prefixes", "0", *args]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("edgeinfer eval: error:") and message in err


@pytest.fixture(scope="module")
def hf_tiny(tiny):
    return AutoModelForCausalLM.from_pretrained(tiny[0], dtype=torch.float32).eval()


def _hf_window_nll(hf, bos: int, ids: list[int], begin: int, end: int, first: int) -> torch.Tensor:
    with torch.no_grad():
        logits = hf(torch.tensor([[bos, *ids[begin:end]]])).logits[0, :-1]
    lp = torch.log_softmax(logits, -1)[first - begin :]
    return -lp.gather(-1, torch.tensor(ids[first:end])[:, None]).squeeze(-1)


@pytest.mark.parametrize(("window", "stride"), [(60, 60), (24, 16)])
def test_sliding_window_nll_matches_transformers(tiny, hf_tiny, window, stride):
    """Every token's NLL equals transformers' on the same window ([BOS] + tokens begin..end)."""
    model, text = tiny
    eng = LLMEngine(EngineConfig(model=model, dtype="float32", num_kv_blocks=4, batch_window_ms=0))
    bos = eng.tokenizer.bos_token_id
    ids = eng.tokenizer.encode(load_text(text).text, add_special_tokens=False)[:60]
    result = compare(Candidate.from_engine("ref", eng), [], ids, bos, window, stride)
    plan = [(0, window, 0)] if window == 60 else [(0, 24, 0), (16, 40, 24), (32, 56, 40), (48, 60, 56)]
    expected = torch.cat([_hf_window_nll(hf_tiny, bos, ids, b, e, f) for b, e, f in plan])
    assert torch.allclose(result.reference_nll, expected, atol=1e-4)
    assert result.reference_perplexity == pytest.approx(math.exp(expected.mean().item()), rel=1e-5)


def test_quantized_kv_cache_shows_in_the_scores(tiny):
    model, text = tiny
    eng = LLMEngine(EngineConfig(model=model, dtype="float32", num_kv_blocks=4, batch_window_ms=0))
    ids = eng.tokenizer.encode(load_text(text).text, add_special_tokens=False)[:40]
    ref = Candidate.from_engine("ref", eng)
    kv = {k: Candidate.from_engine(k, eng, k) for k in ("int8", "fp8_e4m3")}
    comps = compare(ref, list(kv.values()), ids, eng.tokenizer.bos_token_id, 40, 40).comparisons()
    assert all(0 < c.kl_mean < 1e-3 for c in comps.values())


@pytest.mark.skipif(
    importlib.util.find_spec("gensim") is None, reason="gensim (the eval text) is not installed"
)
def test_default_text_is_the_packaged_english_news_corpus():
    text = load_text(DEFAULT_TEXT)
    assert len(text.documents) == 300 and text.source.endswith("lee_background.cor")
    assert text.documents[0].startswith("Hundreds of people have been forced to vacate their homes")
    assert 55_000 < len(text.text.split()) < 65_000
