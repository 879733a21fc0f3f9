"""Every verb of the tour as a new user runs it: a fresh `edgeinfer` process, an empty cache, a Hugging Face
checkpoint directory, every weight method (helpers/new_user.py says what "new user" keeps and drops).

In-process tests cannot see what goes wrong only in a cold process: `generate --quantization int8` once
failed on a fresh cache with `cannot import name 'AutoTokenizer' from 'transformers'` (two threads importing
transformers at once), which no test saw because the test process had imported it long before.

The one-shot commands of the selected tests are started together, as many at a time as there are cores (one
core each), before the module's first test; each test then waits for its own.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from helpers.new_user import (
    CORES,
    assert_one_line_error,
    assert_succeeded,
    describe,
    new_home,
    run_edgeinfer,
    serving,
)
from helpers.tiny_models import CORPUS
from models_moe.tiny_moe import make_tiny_moe
from safetensors.torch import load_file, save_file
from transformers import BertConfig, BertModel, BertTokenizer

pytestmark = [pytest.mark.cli, pytest.mark.timeout(600)]

METHODS = ("none", "int8", "int4", "fp8")
WRITTEN = ("int8", "int4", "fp8")  # what `edgeinfer quantize -q` writes
BERT_DIM = 32
PROMPT = ["--prompt", "The quick brown fox", "--max-tokens", "8"]


class Models:
    """The checkpoints the commands read, as a user has them: Hugging Face directories."""

    def __init__(self, root: Path, llama: str) -> None:
        self.llama = llama
        self.moe = str(make_tiny_moe("qwen3_moe", root / "qwen3_moe"))
        self.llama_bf16 = str(_bf16_copy(Path(llama), root / "llama-bf16"))
        self.bert = str(_tiny_bert(root / "bert"))
        self.text = root / "text.txt"
        self.text.write_text("\n".join(CORPUS * 3))
        self.out = root / "out"  # what quantize and compress write
        self.out.mkdir()


def _bf16_copy(src: Path, dst: Path) -> Path:
    """`src` stored in bf16, as most published checkpoints are: `compress` codes bf16 tensors only."""
    shutil.copytree(src, dst)
    weights = dst / "model.safetensors"
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(weights).items()}, weights, {"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"}))
    return dst


def _tiny_bert(path: Path) -> Path:
    """A random BERT sentence-transformers directory (mean pooling) with a WordPiece vocabulary of the
    tiny models' corpus."""
    words = sorted({w for line in CORPUS for w in re.findall(r"\w+|[^\w\s]", line.lower())})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *words]
    BertTokenizer(vocab={w: i for i, w in enumerate(vocab)}).save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(vocab),
        hidden_size=BERT_DIM,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=2 * BERT_DIM,
        max_position_embeddings=64,
    )
    BertModel(config).save_pretrained(path)
    (path / "modules.json").write_text(
        json.dumps(
            [
                {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
                {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (path / "1_Pooling").mkdir()
    pooling = {"word_embedding_dimension": BERT_DIM, "pooling_mode_mean_tokens": True}
    (path / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return path


def _commands(m: Models) -> dict[str, list[str]]:
    """The one-shot commands, by the name their test asks for."""
    commands = {
        f"generate {q}": ["generate", "--model", m.llama, "--quantization", q, *PROMPT] for q in METHODS
    }
    commands["generate moe int8"] = ["generate", "--model", m.moe, "--quantization", "int8", *PROMPT]
    for q in WRITTEN:
        commands[f"quantize {q}"] = ["quantize", m.llama, str(m.out / q), "--quantization", q]
    commands["compress"] = ["compress", m.llama_bf16, str(m.out / "eiz")]
    commands["embed"] = ["embed", "--model", m.bert, "--text", "edge inference", "--text", "the lazy dog"]
    commands["eval"] = ["eval", "--model", m.llama, "--quantization", "int8", "--text", str(m.text)]
    commands["eval"] += ["--tokens", "120", "--window", "48", "--prefixes", "2", "--prefix-tokens", "8"]
    commands["eval"] += ["--greedy-tokens", "8"]
    missing = str(m.out / "no-such-model")
    bad = ["--quantization", "int3"]
    commands["generate bad quantization"] = ["generate", "--model", m.llama, *bad, *PROMPT]
    commands["quantize missing model"] = ["quantize", missing, str(m.out / "never"), "--quantization", "int8"]
    commands["compress missing model"] = ["compress", missing, str(m.out / "never")]
    commands["embed missing model"] = ["embed", "--model", missing, "--text", "hi"]
    commands["eval bad quantization"] = ["eval", "--model", m.llama, *bad]
    commands["serve missing model"] = ["serve", "--model", f"x={missing}", "--port", "1"]
    commands["serve bad quantization"] = ["serve", "--model", f"x={m.llama}", *bad, "--port", "1"]
    return commands


class Runs:
    """The result of a named command, each run in its own new home; started on a pool of one worker per
    core, either ahead (`start`) or when first asked for."""

    def __init__(
        self, pool: ThreadPoolExecutor, commands: dict[str, list[str]], root: pytest.TempPathFactory
    ) -> None:
        self._pool, self._commands, self._root = pool, commands, root
        self._futures: dict[str, Future[subprocess.CompletedProcess[str]]] = {}

    def start(self, name: str) -> None:
        if name not in self._futures:
            home = new_home(self._root.mktemp("user"))
            self._futures[name] = self._pool.submit(run_edgeinfer, self._commands[name], home)

    def __call__(self, name: str) -> subprocess.CompletedProcess[str]:
        self.start(name)
        return self._futures[name].result()

    def cancel(self) -> None:
        for future in self._futures.values():
            future.cancel()


# The commands each test reads, where the test is not parametrized by one (`command`).
_READS = {
    "test_compress_codes_the_bf16_tensors": ["compress"],
    "test_embed_prints_vectors_of_the_models_dimension": ["embed"],
    "test_eval_prints_perplexity_against_the_baseline": ["eval"],
    "test_serve_the_checkpoints_that_quantize_and_compress_wrote": [
        *(f"quantize {q}" for q in WRITTEN),
        "compress",
    ],
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_llama: str) -> Models:
    return Models(tmp_path_factory.mktemp("new-user-models"), tiny_llama)


@pytest.fixture(scope="module")
def runs(
    request: pytest.FixtureRequest, models: Models, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Runs]:
    """Starts, in the order of the tests, the commands of the tests selected in this module."""
    with ThreadPoolExecutor(max_workers=CORES.count) as pool:
        runs = Runs(pool, _commands(models), tmp_path_factory)
        for item in request.session.items:
            if item.module is request.module:
                callspec = getattr(item, "callspec", None)
                command = callspec.params.get("command") if callspec else None
                for name in [command] if command else _READS.get(item.originalname, []):
                    runs.start(name)
        yield runs
        runs.cancel()


@pytest.mark.parametrize("command", [*(f"generate {q}" for q in METHODS), "generate moe int8"])
def test_generate_with_each_weight_method(runs: Runs, command: str) -> None:
    """Every weight method quantizes the Hugging Face directory at load (calibrated, the default), and a
    MoE checkpoint's expert stacks too."""
    res = runs(command)
    assert_succeeded(res)
    assert res.stdout.endswith("\n") and res.stdout.strip(), describe(res)


@pytest.mark.parametrize("command", [f"quantize {q}" for q in WRITTEN])
def test_quantize_writes_a_compressed_tensors_checkpoint(runs: Runs, models: Models, command: str) -> None:
    res = runs(command)
    assert_succeeded(res)
    written = models.out / command.split()[1]
    assert res.stdout.startswith(f"{written}: quantized "), describe(res)
    assert "quantization_config" in json.loads((written / "config.json").read_text())
    assert (written / "tokenizer.json").is_file()


def test_compress_codes_the_bf16_tensors(runs: Runs, models: Models) -> None:
    res = runs("compress")
    assert_succeeded(res)
    coded = re.search(r"(\d+) tensors \((\d+) exponent-coded\)", res.stdout)
    assert coded and int(coded[2]) > 0, describe(res)


def test_embed_prints_vectors_of_the_models_dimension(runs: Runs) -> None:
    res = runs("embed")
    assert_succeeded(res)
    lines = res.stdout.splitlines()
    assert lines[0] == f"shape: [2, {BERT_DIM}]", describe(res)
    assert [line.split(":")[0] for line in lines[1:]] == ["'edge inference'", "'the lazy dog'"]
    for line in lines[1:]:
        shown = re.search(r"\[(.*), \.\.\.\]$", line)
        assert shown and all(abs(float(v)) < 100 for v in shown[1].split(", ")), line


def test_eval_prints_perplexity_against_the_baseline(runs: Runs) -> None:
    res = runs("eval")
    assert_succeeded(res)
    row = re.search(r"^\| perplexity \| ([\d.]+) \| ([\d.]+) ", res.stdout, re.MULTILINE)
    assert row, describe(res)
    assert 1 < float(row[1]) < 10_000 and 1 < float(row[2]) < 10_000


@pytest.mark.parametrize(
    ("command", "says"),
    [
        ("generate bad quantization", "unknown quantization method 'int3'"),
        ("quantize missing model", "no such file or directory"),
        ("compress missing model", "no such file or directory"),
        ("embed missing model", "not an embedding model"),
        ("eval bad quantization", "unknown quantization method 'int3'"),
        ("serve missing model", "no such file or directory"),
        ("serve bad quantization", "unknown quantization method 'int3'"),
    ],
)
def test_a_mistake_is_one_line_and_a_nonzero_exit(runs: Runs, command: str, says: str) -> None:
    assert_one_line_error(runs(command), command.split()[0], says)


def test_serve_quantizes_at_load_and_answers_the_first_request(models: Models, tmp_path: Path) -> None:
    """The tour's `serve --quantization int4`, on a Hugging Face directory; the model loads at the first
    request, on the pool's loader thread."""
    with serving(["--model", f"tiny={models.llama}", "--quantization", "int4"], new_home(tmp_path)) as url:
        _assert_completes(url, "tiny")


def test_serve_the_checkpoints_that_quantize_and_compress_wrote(
    runs: Runs, models: Models, tmp_path: Path
) -> None:
    for command in _READS["test_serve_the_checkpoints_that_quantize_and_compress_wrote"]:
        assert_succeeded(runs(command))
    served = {q: models.out / q for q in WRITTEN} | {"eiz": models.out / "eiz", "plain": Path(models.llama)}
    args = [arg for name, path in served.items() for arg in ("--model", f"{name}={path}")]
    with serving(args, new_home(tmp_path)) as url:
        for name in served:
            _assert_completes(url, name)


def _assert_completes(url: str, model: str) -> None:
    body = {"model": model, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}
    response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, (model, response.text)
    (choice,) = response.json()["choices"]
    assert choice["text"] and response.json()["usage"]["completion_tokens"] > 0, (model, response.json())
