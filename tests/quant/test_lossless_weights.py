"""Lossless resident bf16 weights (kernels/lossless.py, lossless_gemv.cpp): the form keeps every bit of every
family's weights, the kernels on it give `bf16_gemv`'s sums bit for bit, an engine serving it answers as the
bf16 one does, and the prepared-form cache keeps the form so a second load does not encode again."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch
from helpers.fused_step import bf16_engine, greedy_answers
from helpers.tiny_models import MOE_FAMILIES, make_tiny
from safetensors.torch import load_file, save_file

from edgeinfer.engine import kernels
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.kernels import lossless, ops
from edgeinfer.engine.kernels.lossless import LosslessEmbedding, LosslessExperts, LosslessLinear
from edgeinfer.engine.loading import load_model, weight_bytes
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.model.moe import SparseMoeBlock

PROMPTS = [[3, 14, 15, 92, 65], list(range(4, 26)), [7] * 9]
MAX_TOKENS = 8


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def assert_round_trip(w: torch.Tensor) -> lossless.LosslessForm:
    """The form of `w` decodes to `w`'s bits, through torch's ops, the kernel and row lookups."""
    form = lossless.encode(w)
    assert torch.equal(bits(lossless.decode(form)), bits(w))
    assert torch.equal(bits(ops.lossless_decode(form.in_features, *form.tensors().values())), bits(w))
    ids = torch.tensor([[0, len(w) - 1], [len(w) // 2, 0]])
    assert torch.equal(bits(ops.lossless_rows(ids, form.in_features, *form.tensors().values())), bits(w[ids]))
    return form


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory) -> str:
    return str(make_tiny("qwen3_moe", tmp_path_factory.mktemp("moe") / "qwen3_moe"))


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "moe"])
def test_round_trip_on_every_familys_weights(ops, tiny_models, tiny_moe, family):
    path = tiny_moe if family == "moe" else tiny_models[family]
    matrices = 0
    for _, t in open_checkpoint(path).iter_tensors(torch.bfloat16):
        if t.dim() >= 2:  # expert stacks [E, N, K] as one matrix of all their rows
            assert_round_trip(t.reshape(-1, t.shape[-1]))
            matrices += 1
    assert matrices


def test_round_trip_of_edge_values(ops):
    w = torch.randn(37, 70).bfloat16()
    patterns = w.view(torch.int16).reshape(-1)
    patterns[:512] = torch.arange(-256, 256, dtype=torch.int16) * 128  # every exponent, both signs
    specials = [0.0, -0.0, float("inf"), float("-inf"), float("nan"), 1e-40, -1e-40, 3e38]
    w.reshape(-1)[600 : 600 + len(specials)] = torch.tensor(specials).bfloat16()
    patterns[700] = 0x7F81  # a signalling NaN's payload
    form = assert_round_trip(w)
    assert len(form.escapes) > lossless.PAD  # high bytes past the table's seven went through the escape list
    for shape in [(1, 1), (16, 32), (17, 33), (5, 100), (3, 128)]:  # rows past a group, inputs past a block
        assert_round_trip(torch.randn(shape).bfloat16())
    assert_round_trip(torch.zeros(3, 40).bfloat16())


# every path: up to 6 rows decoded in registers; more through the tiles (4 x 4, then 1-3 rows left)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 9, 10, 17, 32, 64])
# inputs: whole blocks of 64, a last block with one chunk of 32 (partial or whole) or two; rows long enough
# that a task's blocks hold fewer rows (1,100 inputs) and that the tiles decode none of the next (2,048)
@pytest.mark.parametrize(
    "shape", [(300, 640), (37, 70), (16, 32), (20, 100), (9, 96), (250, 1100), (190, 2048)]
)
def test_gemv_equals_bf16_gemv(ops, rows, shape):
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(shape, generator=g) * 0.05).bfloat16()
    w.reshape(-1)[::97] = 0.0  # exponents outside the table: escapes in many blocks
    w.reshape(-1)[::89] = 3.0
    form = lossless.encode(w).tensors().values()
    x = torch.randn(rows, shape[1], generator=g).bfloat16()
    assert torch.equal(bits(ops.lossless_gemv(x, *form)), bits(ops.bf16_gemv(x, w)))
    want, got = torch.empty(rows, shape[0]), torch.empty(rows, shape[0])
    ops.bf16_gemv_out(x, w, want)
    ops.lossless_gemv_out(x, *form, got)
    assert torch.equal(got, want)


def test_gemv_equals_bf16_gemv_on_every_variant(level):
    # below AVX512-BF16 the form is decoded and multiplied as the bf16 weight is on that CPU
    w = (torch.randn(48, 96) * 0.05).bfloat16()
    x = torch.randn(3, 96).bfloat16()
    form = lossless.encode(w).tensors().values()
    assert torch.equal(bits(ops.lossless_gemv(x, *form)), bits(ops.bf16_gemv(x, w)))


@pytest.mark.parametrize("family", ["gemma3", "qwen3", "llama_bias"])
def test_lossless_engine_answers_as_bf16(ops, tiny_models, family):
    if not kernels.cpu_has_avx2():
        pytest.skip("bf16 models keep torch's kernels without AVX2")
    plain = bf16_engine(tiny_models[family], prepared_cache=False)
    packed = bf16_engine(tiny_models[family], prepared_cache=False, weights="lossless")
    model = packed.model
    assert not any(type(m) in (torch.nn.Linear, torch.nn.Embedding) for m in model.modules())
    assert any(isinstance(m, LosslessEmbedding) for m in model.modules())
    assert packed.runner.fused is not None  # the fused decode step reads the form too
    assert packed.layout.weight_bytes < plain.layout.weight_bytes
    for together in (False, True):  # one sequence a step, then batched steps
        assert greedy_answers(packed, PROMPTS, MAX_TOKENS, together) == greedy_answers(
            plain, PROMPTS, MAX_TOKENS, together
        )
    ids = torch.tensor([[1, 17, 45, 200]])
    hidden = torch.randn(4, plain.model.args.hidden).bfloat16()
    assert torch.equal(packed.model.compute_logits(hidden), plain.model.compute_logits(hidden))
    assert torch.equal(model.model.embed_tokens(ids), plain.model.model.embed_tokens(ids))


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_lossless_moe_answers_as_bf16(ops, tmp_path, family):
    """Expert stacks (and shared experts) in the form, through our MoE block: the bf16 model's tokens and
    logprobs, a sequence at a time and batched."""
    if not kernels.cpu_has_avx2():
        pytest.skip("bf16 models keep torch's kernels without AVX2")
    path = str(make_tiny(family, tmp_path / family))
    plain = bf16_engine(path, prepared_cache=False)
    packed = bf16_engine(path, prepared_cache=False, weights="lossless")
    blocks = [m for m in packed.model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and all(isinstance(b.experts.down_proj, LosslessExperts) for b in blocks)
    assert all(b.kernel_block is not None for b in blocks)
    assert packed.layout.weight_bytes < plain.layout.weight_bytes
    for together in (False, True):
        assert greedy_answers(packed, PROMPTS, MAX_TOKENS, together) == greedy_answers(
            plain, PROMPTS, MAX_TOKENS, together
        )


def load(path: str, cache_dir: Path, **kw) -> torch.nn.Module:
    config = EngineConfig(model=path, cache_dir=str(cache_dir), **kw)
    return load_model(open_checkpoint(path), torch.bfloat16, torch.device("cpu"), config)


def test_prepared_cache_keeps_the_form(ops, tiny_models, tmp_path, monkeypatch, caplog):
    fresh = load(tiny_models["gemma3"], tmp_path, weights="lossless")
    monkeypatch.setattr(lossless, "encode", lambda w: pytest.fail("a cached load encoded again"))
    with caplog.at_level(logging.INFO, logger="edgeinfer.engine.prepared"):
        cached = load(tiny_models["gemma3"], tmp_path, weights="lossless")
    assert "loaded the prepared model" in caplog.text
    heads = [m for m in cached.modules() if isinstance(m, LosslessLinear)]
    assert heads and weight_bytes(cached) == weight_bytes(fresh)
    for a, b in zip(fresh.state_dict().values(), cached.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # a tied head and its embedding share one form in the cache as in the fresh load
    assert cached.lm_head.planes is cached.model.embed_tokens.planes


def test_prepared_cache_keeps_the_expert_stacks(ops, tiny_moe, tmp_path, monkeypatch, caplog):
    fresh = load(tiny_moe, tmp_path, weights="lossless")
    monkeypatch.setattr(lossless, "encode", lambda w: pytest.fail("a cached load encoded again"))
    with caplog.at_level(logging.INFO, logger="edgeinfer.engine.prepared"):
        cached = load(tiny_moe, tmp_path, weights="lossless")
    assert "loaded the prepared model" in caplog.text
    stacks = [m for m in cached.modules() if isinstance(m, LosslessExperts)]
    assert stacks and all(s.num_experts == 8 for s in stacks)
    for a, b in zip(fresh.state_dict().values(), cached.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_eiz_directory_serves_the_form(ops, tiny_models, tmp_path):
    from edgeinfer.cli import main

    src = tmp_path / "bf16"
    shutil.copytree(tiny_models["qwen3"], src)
    weights = src / "model.safetensors"
    save_file({n: t.to(torch.bfloat16) for n, t in load_file(str(weights)).items()}, str(weights))
    assert main(["compress", str(src), str(tmp_path / "eiz")]) == 0
    model = load(str(tmp_path / "eiz"), tmp_path, prepared_cache=False)
    assert any(isinstance(m, LosslessLinear) for m in model.modules())
    as_bf16 = load(str(tmp_path / "eiz"), tmp_path, prepared_cache=False, weights="bf16")
    assert not any(isinstance(m, LosslessLinear) for m in as_bf16.modules())


def test_config_refuses_lossless_where_the_kernels_cannot_read_it():
    for bad in ({"quantization": "int8"}, {"dtype": "float32"}, {"cpu_gemv": False}, {"weights": "zip"}):
        with pytest.raises(ValueError, match="weights"):
            EngineConfig(**({"weights": "lossless"} | bad))


@pytest.mark.gemma
def test_default_model_resident_bytes_within_three_quarters_of_bf16(ops, default_gguf):
    """Gemma 3 270M's matrices (the tied embedding is most of them) in the form: <= 75 % of bf16."""
    stored = packed = 0
    for _, t in open_checkpoint(str(default_gguf)).iter_tensors(torch.bfloat16):
        if t.dim() == 2:
            stored += 2 * t.numel()
            packed += lossless.encode(t).nbytes()
    assert packed <= 0.75 * stored, f"{packed / stored:.1%} of bf16"
