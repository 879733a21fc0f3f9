"""HF directories (config.json + safetensors): tensors, dtypes, shards, progress, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_gguf import tiny_hf_model

from edgeinfer.engine.model.loader import CheckpointError, open_checkpoint


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return tiny_hf_model("llama")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory, llama: torch.nn.Module) -> Path:
    path = tmp_path_factory.mktemp("hf")
    llama.save_pretrained(path)
    return path


def write_dir(path: Path, tensors: dict[str, torch.Tensor], config: object = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"} if config is None else config
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def test_config_and_every_tensor(hf_dir: Path, llama: torch.nn.Module) -> None:
    ckpt = open_checkpoint(str(hf_dir))
    assert ckpt.config == json.loads((hf_dir / "config.json").read_text())
    assert ckpt.format == "safetensors" and ckpt.gguf_path is None and ckpt.tokenizer_dir == hf_dir
    reference = llama.state_dict()
    tensors = dict(ckpt.iter_tensors(torch.float32))
    assert set(tensors) == set(reference) == set(ckpt.tensor_names())
    for name, tensor in tensors.items():
        assert torch.equal(tensor, reference[name]), name


def test_floats_are_cast_integers_kept(tmp_path: Path) -> None:
    weight = torch.randn(4, 8)
    path = write_dir(tmp_path / "m", {"w": weight, "ids": torch.arange(5, dtype=torch.int64)})
    tensors = dict(open_checkpoint(path).iter_tensors(torch.bfloat16))
    assert tensors["w"].dtype == torch.bfloat16 and torch.equal(tensors["w"], weight.to(torch.bfloat16))
    assert tensors["ids"].dtype == torch.int64 and tensors["ids"].tolist() == [0, 1, 2, 3, 4]


def test_sharded_checkpoint_reads_every_shard(tmp_path: Path, llama: torch.nn.Module) -> None:
    llama.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 2
    tensors = dict(open_checkpoint(tmp_path).iter_tensors())
    assert set(tensors) == set(llama.state_dict())


def test_progress_bar_only_for_many_tensors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    few = write_dir(tmp_path / "few", {f"t{i}": torch.zeros(2) for i in range(50)})
    list(open_checkpoint(few).iter_tensors())
    assert "Loading" not in capsys.readouterr().err
    many = write_dir(tmp_path / "many", {f"t{i}": torch.zeros(2) for i in range(51)})
    list(open_checkpoint(many).iter_tensors())
    assert "Loading many" in capsys.readouterr().err


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nope: no such file or directory .*gemma-3-270m"):
        open_checkpoint(tmp_path / "nope")


def test_directory_without_config(tmp_path: Path) -> None:
    save_file({"w": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"not a checkpoint directory \(no config\.json\)"):
        open_checkpoint(tmp_path)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "unreadable config"),
        ("[1, 2]", "expected a JSON object"),
        ('{"model_type": "x"}', "architectures"),
    ],
)
def test_bad_config(tmp_path: Path, content: str, message: str) -> None:
    write_dir(tmp_path, {"w": torch.zeros(2)})
    (tmp_path / "config.json").write_text(content)
    with pytest.raises(CheckpointError, match=rf"config\.json: .*{message}"):
        open_checkpoint(tmp_path)


def test_directory_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights"):
        open_checkpoint(tmp_path)


def test_truncated_and_corrupt_weights(tmp_path: Path) -> None:
    path = write_dir(tmp_path, {"w": torch.randn(64, 64)})
    weights = path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        open_checkpoint(path)
    weights.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage header}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: corrupt or truncated"):
        open_checkpoint(path)


def test_index_naming_a_missing_shard(tmp_path: Path) -> None:
    write_dir(tmp_path, {"w": torch.zeros(2)})
    index = {"weight_map": {"w": "model.safetensors", "v": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"missing: model-00002-of-00002\.safetensors"):
        open_checkpoint(tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match=r"weights\.bin: not a checkpoint"):
        open_checkpoint(path)


def test_every_dtype_and_shape_is_read_as_stored(tmp_path: Path) -> None:
    """Tensors are read from the file, not memory-mapped: every safetensors dtype, a scalar and an empty
    tensor come back as `safetensors` itself reads them, and `None` keeps each one's dtype."""
    gen = torch.Generator().manual_seed(0)
    floats = {str(d): torch.randn(3, 5, generator=gen).to(d) for d in (*_FLOATS, torch.float8_e5m2)}
    ints = {str(d): torch.randint(0, 100, (4, 2), generator=gen).to(d) for d in (*_INTS, torch.uint64)}
    shapes = {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 7), "flags": torch.tensor([True, False])}
    stored = floats | ints | shapes
    path = write_dir(tmp_path / "m", stored)
    got = dict(open_checkpoint(path).iter_tensors(None))
    assert set(got) == set(stored)
    for name, tensor in stored.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(_bytes(got[name]), _bytes(tensor)), name


_FLOATS = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn)
_INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)  # by bytes: float8 has no equality of its own
