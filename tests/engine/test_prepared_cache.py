"""The prepared-form cache (engine/prepared): a cached load gives bit-identical logits to a fresh one, a
damaged entry is rejected and rebuilt, a changed source or setting misses, and the cache can be disabled."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from edgeinfer.engine import kernels
from edgeinfer.engine.attention.backend import get_attention_backend
from edgeinfer.engine.attention.metadata import AttentionMetadata
from edgeinfer.engine.attention.storage import KVCacheStorage
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.loading import load_model
from edgeinfer.engine.model.loader import open_checkpoint
from edgeinfer.engine.prepared import store
from edgeinfer.engine.quant.layers import PreparedModule

CPU = torch.device("cpu")
IDS = torch.tensor([1, 17, 45, 200, 9, 33, 120, 7, 64, 3, 88])
HIT = "loaded the prepared model"
REJECTED = "rejected"


def logits(model: torch.nn.Module, ids: torch.Tensor = IDS) -> torch.Tensor:
    """One prefill of `ids` through the paged attention path."""
    n, block = len(ids), 4
    storage = KVCacheStorage(model.kv_spec, 8, block, torch.float32, CPU)
    backend = get_attention_backend("torch", storage)
    blocks = list(range((n + block - 1) // block))
    slots = torch.tensor([blocks[p // block] * block + p % block for p in range(n)])
    backend.begin(AttentionMetadata(slots, [0], [n], [n], torch.tensor([blocks]), 0, block))
    with torch.no_grad():
        return model.compute_logits(model(ids, torch.arange(n), backend))


def load(path: str, cache_dir: Path, quantization: str | None = None, **kw) -> torch.nn.Module:
    """Quantized without calibration (which only changes the values, and costs seconds per load)."""
    config = EngineConfig(
        model=path, quantization=quantization, cache_dir=str(cache_dir), calibrate_quantization=False, **kw
    )
    return load_model(open_checkpoint(path), torch.bfloat16, CPU, config)


def entries(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "prepared").glob("*.safetensors"))


def kernels_of(model: torch.nn.Module) -> list[str]:
    return [m.kernel for m in model.modules() if isinstance(m, PreparedModule)]


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_cached_load_is_bit_identical(quantization, tiny_models, tmp_path, caplog):
    path = tiny_models["gemma3"]
    fresh = load(path, tmp_path, quantization, prepared_cache=False)
    assert not (tmp_path / "prepared").exists()
    want = logits(fresh)
    first = load(path, tmp_path, quantization)  # a miss: loads afresh and writes the entry
    assert len(entries(tmp_path)) == 1
    with caplog.at_level(logging.INFO, logger="edgeinfer.engine.prepared"):
        cached = load(path, tmp_path, quantization)
    assert HIT in caplog.text
    assert torch.equal(logits(first), want)
    assert torch.equal(logits(cached), want)
    assert kernels_of(cached) == kernels_of(fresh)
    if quantization:
        assert kernels_of(cached)  # the quantized modules really came back as quantized modules
    if quantization is None:  # tied embeddings stay one tensor
        assert cached.lm_head.weight is cached.model.embed_tokens.weight


def _flip_bytes(entry: Path) -> None:
    data = bytearray(entry.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    entry.write_bytes(bytes(data))


def _truncate(entry: Path) -> None:
    data = entry.read_bytes()
    entry.write_bytes(data[: len(data) - 1000])


@pytest.mark.parametrize("damage", [_flip_bytes, _truncate], ids=["flipped", "truncated"])
def test_damaged_entry_is_rejected_and_rebuilt(damage, tiny_models, tmp_path, caplog):
    path = tiny_models["gemma3"]
    want = logits(load(path, tmp_path, "int8", prepared_cache=False))
    load(path, tmp_path, "int8")
    (entry,) = entries(tmp_path)
    before = entry.read_bytes()
    damage(entry)
    with caplog.at_level(logging.INFO, logger="edgeinfer.engine.prepared"):
        rebuilt = load(path, tmp_path, "int8")
    assert REJECTED in caplog.text and HIT not in caplog.text
    assert torch.equal(logits(rebuilt), want)
    assert entry.read_bytes() == before  # written again, whole
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="edgeinfer.engine.prepared"):
        again = load(path, tmp_path, "int8")
    assert HIT in caplog.text
    assert torch.equal(logits(again), want)


def test_a_checked_entry_is_not_hashed_again_until_it_is_written(tiny_models, tmp_path, monkeypatch, caplog):
    path = tiny_models["gemma3"]
    want = logits(load(path, tmp_path, "int8"))  # a miss: writes the entry
    hashed = []
    real = store._digest
    monkeypatch.setattr(store, "_digest", lambda tensors: hashed.append(1) or real(tensors))
    load(path, tmp_path, "int8")  # the first hit hashes the file and stamps it
    assert len(hashed) == 1
    assert torch.equal(logits(load(path, tmp_path, "int8")), want)
    assert len(hashed) == 1  # the stamp matched: no second hash
    (entry,) = entries(tmp_path)
    time.sleep(0.05)  # file times move in the kernel's ticks (a few ms): the write lands in a later one
    _flip_bytes(entry)
    with caplog.at_level(logging.INFO, logger="edgeinfer.engine.prepared"):
        rebuilt = load(path, tmp_path, "int8")
    assert len(hashed) >= 2 and REJECTED in caplog.text
    assert torch.equal(logits(rebuilt), want)


def test_changed_source_or_settings_miss(tiny_models, tmp_path, caplog):
    src = tmp_path / "model"
    shutil.copytree(tiny_models["gemma3"], src)
    cache = tmp_path / "cache"
    old = logits(load(str(src), cache))
    weights = src / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name] * 2
    save_file(tensors, str(weights), metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="edgeinfer.engine.prepared"):
        changed = load(str(src), cache)
        assert HIT not in caplog.text
        assert len(entries(cache)) == 2
        load(str(src), cache, "int8")  # another setting: another entry
        assert HIT not in caplog.text
    assert len(entries(cache)) == 3
    got = logits(changed)
    assert not torch.equal(got, old)
    assert torch.equal(got, logits(load(str(src), cache, prepared_cache=False)))


def test_eiz_directory_loads_directly(tiny_models, tmp_path):
    """A `edgeinfer compress`ed directory serves the same logits as the bf16 checkpoint it came from, and a
    damaged `.eiz` fails with the file named."""
    from edgeinfer.cli import main
    from edgeinfer.engine.model.loader import CheckpointError
    from edgeinfer.engine.model.loader.eiz_checkpoint import EizCheckpoint

    src = tmp_path / "bf16"
    shutil.copytree(tiny_models["gemma3"], src)
    weights = src / "model.safetensors"
    save_file({n: t.to(torch.bfloat16) for n, t in load_file(str(weights)).items()}, str(weights))
    out = tmp_path / "eiz"
    assert main(["compress", str(src), str(out)]) == 0
    ckpt = open_checkpoint(str(out))
    assert isinstance(ckpt, EizCheckpoint)
    got = logits(load(str(out), tmp_path / "cache", prepared_cache=False))
    assert torch.equal(got, logits(load(str(src), tmp_path / "cache", prepared_cache=False)))
    data = bytearray((out / "model.eiz").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (out / "model.eiz").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"model\.eiz"):
        load(str(out), tmp_path / "cache", prepared_cache=False)


@pytest.mark.gemma
def test_real_default_model_cached_bf16_is_bit_identical(default_gguf, tmp_path, caplog):
    """Gemma 3 270M from its Q4_K_M GGUF (dequantized to bf16, ~12 s) against its cached form (~0.2 s)."""
    fresh = load(str(default_gguf), tmp_path)  # a miss: dequantizes and writes the entry
    with caplog.at_level(logging.INFO, logger="edgeinfer.engine.prepared"):
        cached = load(str(default_gguf), tmp_path)
    assert HIT in caplog.text
    ids = torch.tensor([2, 818, 5279, 529, 7001, 563, 236743, 100, 4000, 90000])
    assert torch.equal(logits(cached, ids), logits(fresh, ids))


def test_a_failed_kernel_build_is_not_cached(tiny_models, tmp_path, monkeypatch):
    # A model left on torch's kernels only because ours did not build is not what its key stands for
    # (the next start, with the kernels working, must not load it); an invalid ISA cap fails the build.
    path = tiny_models["gemma3"]
    monkeypatch.setenv(kernels.ISA_ENV, "no-such-isa")
    broken = load(path, tmp_path)
    if not (kernels.cpu_has_avx2() and kernels.count_bf16_linears(broken)):
        pytest.skip("our bf16 kernels need AVX2 (x86)")
    assert entries(tmp_path) == []
    monkeypatch.delenv(kernels.ISA_ENV)
    load(path, tmp_path)
    assert len(entries(tmp_path)) == 1


def test_entries_unused_for_weeks_are_removed_when_one_is_written(tiny_models, tmp_path):
    """A load marks its entry used; writing an entry removes the others unused for `UNUSED_DAYS`."""
    path = tiny_models["llama"]
    load(path, tmp_path)
    (used,) = entries(tmp_path)
    weeks_ago = time.time() - (store.UNUSED_DAYS + 1) * 86400
    os.utime(used, (weeks_ago, weeks_ago))
    load(path, tmp_path)  # a hit: the entry is in use again
    assert used.stat().st_mtime > weeks_ago + 86400
    stale = used.with_name("0" * 32 + ".safetensors")
    shutil.copy(used, stale)
    os.utime(stale, (weeks_ago, weeks_ago))
    recent = used.with_name("1" * 32 + ".safetensors")
    shutil.copy(used, recent)
    load(path, tmp_path, "int8")  # writes a new entry
    assert not stale.exists() and recent.exists() and used.exists() and len(entries(tmp_path)) == 3
