"""Lossless bf16 codec: bit-exact round trips (special values included), the Huffman code's invariants,
and refusal of truncated or corrupted files with the affected tensor named."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from edgeinfer.engine.model.loader.codec import CodecError, compress_tensors, huffman, open_compressed
from edgeinfer.engine.model.loader.codec.container import HEADER, read_index

# NaNs with several payloads and both signs, +-inf, +-0, subnormals, extremes of the normal range
SPECIAL_BITS = [
    *(0x7FC0, 0x7F81, 0x7FFF, 0xFFC0, 0xFF81),  # NaN
    *(0x7F80, 0xFF80, 0x0000, 0x8000),  # +-inf, +-0
    *(0x0001, 0x007F, 0x8001, 0x807F),  # subnormals
    *(0x0080, 0x8080, 0x7F7F, 0xFF7F),  # smallest normals, largest finite
]


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16)


def from_bits(values: list[int] | np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.asarray(values, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def weights_with_specials(n: int = 40000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)
    idx = torch.randperm(n, generator=g)[: len(SPECIAL_BITS)]
    w[idx] = from_bits(SPECIAL_BITS)
    return w.reshape(200, n // 200)


def test_huffman_round_trip_and_length_limit():
    """Fibonacci counts make a maximally deep tree (length 39 unlimited); the limit keeps codes <= 12 bits
    while the Kraft sum stays <= 1, so the code is still prefix-free and decodes."""
    fib = [1, 1]
    while len(fib) < 40:
        fib.append(fib[-1] + fib[-2])
    counts = np.zeros(256, dtype=np.int64)
    counts[:40] = fib
    lengths = huffman.code_lengths(counts)
    assert lengths.max() == huffman.MAX_LEN
    assert sum(2.0 ** -int(n) for n in lengths if n) <= 1.0
    symbols = np.repeat(np.arange(40, dtype=np.uint8), np.minimum(fib, 3000))
    symbols = np.random.default_rng(0).permutation(symbols)
    stream, chunks = huffman.encode(symbols, lengths)
    assert np.array_equal(huffman.decode(stream, chunks, len(symbols), lengths), symbols)


def test_huffman_single_symbol():
    symbols = np.full(1000, 7, dtype=np.uint8)
    lengths = huffman.code_lengths(np.bincount(symbols, minlength=256))
    stream, chunks = huffman.encode(symbols, lengths)
    assert len(stream) == 1024 // 8  # one bit each; the last chunk is padded to CHUNK (256) symbols
    assert np.array_equal(huffman.decode(stream, chunks, 1000, lengths), symbols)


def test_bit_exact_with_special_values(tmp_path: Path):
    every_pattern = from_bits(np.arange(65536))  # all 65536 bf16 bit patterns, inside a weight-like tensor
    mixed = torch.cat([every_pattern, (torch.randn(300000) * 0.02).to(torch.bfloat16)])
    tensors = {
        "w": weights_with_specials(),
        "mixed": mixed[torch.randperm(len(mixed))],
        "scalar": torch.tensor(1.5, dtype=torch.bfloat16),
        "empty": torch.empty(0, 3, dtype=torch.bfloat16),
        "f32": torch.randn(3, 5),
        "ids": torch.arange(10),
        "fp8": torch.randn(16).to(torch.float8_e4m3fn),
    }
    stats = compress_tensors(tensors.items(), tmp_path / "m.eiz")
    assert stats.coded == 2
    out = dict(open_compressed(tmp_path / "m.eiz"))
    assert list(out) == list(tensors)
    for name, t in tensors.items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape
        assert torch.equal(out[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_weights_shrink_to_at_most_85_percent(tmp_path: Path):
    w = (torch.randn(512, 512) * 0.02).to(torch.bfloat16)
    stats = compress_tensors([("w", w)], tmp_path / "m.eiz")
    assert stats.ratio <= 0.85
    assert open_compressed(tmp_path / "m.eiz").bytes_saved == stats.bytes_saved > 0


def write_two(tmp_path: Path) -> tuple[Path, dict]:
    path = tmp_path / "m.eiz"
    compress_tensors(
        [("first", weights_with_specials(seed=1)), ("second", weights_with_specials(seed=2))], path
    )
    index, data_start = read_index(path)
    return path, {e["name"]: (data_start, e) for e in index["tensors"]}


def test_truncated_file_names_the_first_missing_tensor(tmp_path: Path):
    path, entries = write_two(tmp_path)
    data_start, second = entries["second"]
    offset, length, _ = second["sections"]["exponents"]
    raw = path.read_bytes()
    path.write_bytes(raw[: data_start + offset + length // 2])
    with pytest.raises(CodecError, match="truncated: tensor 'second'"):
        open_compressed(path)
    path.write_bytes(raw[: HEADER.size + 10])
    with pytest.raises(CodecError, match="truncated inside the index"):
        open_compressed(path)


def test_corrupted_section_is_refused_naming_the_tensor(tmp_path: Path):
    path, entries = write_two(tmp_path)
    data_start, first = entries["first"]
    offset, _, _ = first["sections"]["sign_mantissa"]
    raw = bytearray(path.read_bytes())
    raw[data_start + offset + 100] ^= 0x10
    path.write_bytes(bytes(raw))
    f = open_compressed(path)
    assert torch.equal(bits_of(f.read("second")), bits_of(weights_with_specials(seed=2)))
    with pytest.raises(CodecError, match="tensor 'first': sign_mantissa checksum mismatch"):
        f.read("first")


def test_corrupted_index_or_header(tmp_path: Path):
    path, _ = write_two(tmp_path)
    raw = bytearray(path.read_bytes())
    raw[HEADER.size + 5] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CodecError, match="index checksum mismatch"):
        open_compressed(path)
    path.write_bytes(b"PK\x03\x04" + bytes(raw[4:]))
    with pytest.raises(CodecError, match="bad magic"):
        open_compressed(path)


def test_duplicate_names_and_unknown_tensor(tmp_path: Path):
    t = torch.zeros(3, dtype=torch.bfloat16)
    with pytest.raises(CodecError, match="duplicate tensor name 'a'"):
        compress_tensors([("a", t), ("a", t)], tmp_path / "d.eiz")
    compress_tensors([("a", t)], tmp_path / "ok.eiz")
    with pytest.raises(CodecError, match="no tensor named 'b'"):
        open_compressed(tmp_path / "ok.eiz").read("b")
