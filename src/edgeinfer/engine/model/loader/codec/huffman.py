"""Canonical, length-limited Huffman coding of byte symbols, encoded and decoded with numpy (no per-symbol
Python loops).

The stream is cut into chunks of `CHUNK` symbols, each starting on a byte boundary, with the byte length
of every chunk stored (uint16). Decoding walks all chunks in lock-step: step `i` reads a `MAX_LEN`-bit window
at each chunk's bit cursor, looks the symbol and its length up in a `2**MAX_LEN` table, and advances every
cursor at once, so a tensor takes `CHUNK` vectorised steps whatever its size.
"""

from __future__ import annotations

import heapq

import numpy as np

MAX_LEN = 12  # decode table of 4096 entries; with <= 256 symbols any MAX_LEN >= 8 is feasible
CHUNK = 256  # symbols per chunk: the uint16 chunk lengths cost 16/256 bits per symbol
_PIECE = CHUNK * 16384  # symbols encoded per numpy pass, to bound temporary memory
_SLAB = 16384  # chunks decoded together: a slab of stream that stays in cache across the CHUNK steps


def code_lengths(counts: np.ndarray, max_len: int = MAX_LEN) -> np.ndarray:
    """Huffman code length of each of the 256 symbols (0 for absent ones), capped at `max_len`."""
    lengths = np.zeros(256, dtype=np.uint8)
    present = [int(s) for s in np.flatnonzero(counts)]
    if len(present) == 1:
        lengths[present[0]] = 1
        return lengths
    # heap of (weight, tiebreak, symbols in the subtree); each merge deepens both subtrees by one
    heap = [(int(counts[s]), s, [s]) for s in present]
    heapq.heapify(heap)
    depth = dict.fromkeys(present, 0)
    tiebreak = 256
    while len(heap) > 1:
        w1, _, a = heapq.heappop(heap)
        w2, _, b = heapq.heappop(heap)
        for s in a + b:
            depth[s] += 1
        heapq.heappush(heap, (w1 + w2, tiebreak, a + b))
        tiebreak += 1
    for s, d in depth.items():
        lengths[s] = d
    return _limit(lengths, counts, max_len)


def _limit(lengths: np.ndarray, counts: np.ndarray, max_len: int) -> np.ndarray:
    """Cap lengths at `max_len`, then lengthen short codes until the Kraft sum fits again."""
    if lengths.max() <= max_len:
        return lengths
    lengths = np.minimum(lengths, max_len)
    kraft = sum(1 << (max_len - int(n)) for n in lengths if n)
    while kraft > 1 << max_len:
        # lengthen the longest code that can still grow (least frequent among ties): smallest loss
        grow = [s for s in np.flatnonzero(lengths) if lengths[s] < max_len]
        s = max(grow, key=lambda s: (lengths[s], -counts[s]))
        kraft -= 1 << (max_len - int(lengths[s]) - 1)
        lengths[s] += 1
    return lengths


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical code of every symbol (uint32), assigned in (length, symbol) order."""
    codes = np.zeros(256, dtype=np.uint32)
    code, prev = 0, 0
    for s in sorted(np.flatnonzero(lengths), key=lambda s: (lengths[s], s)):
        code <<= int(lengths[s]) - prev
        prev = int(lengths[s])
        codes[s] = code
        code += 1
    return codes


def decode_tables(lengths: np.ndarray, max_len: int = MAX_LEN) -> tuple[np.ndarray, np.ndarray]:
    """(symbol, length) for every `max_len`-bit window: all windows that start with a code map to it."""
    sym = np.zeros(1 << max_len, dtype=np.uint8)
    size = np.zeros(1 << max_len, dtype=np.uint8)
    codes = canonical_codes(lengths)
    for s in np.flatnonzero(lengths):
        shift = max_len - int(lengths[s])
        lo = int(codes[s]) << shift
        sym[lo : lo + (1 << shift)] = s
        size[lo : lo + (1 << shift)] = lengths[s]
    return sym, size


def encode(symbols: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Encode uint8 symbols -> (byte stream, uint16 byte length of each chunk)."""
    codes = canonical_codes(lengths)
    fill = int(np.flatnonzero(lengths)[0])  # pads the last chunk; decoding drops it
    streams, chunk_lens = [], []
    for start in range(0, len(symbols), _PIECE):
        piece = symbols[start : start + _PIECE]
        pad = (-len(piece)) % CHUNK
        if pad:
            piece = np.concatenate([piece, np.full(pad, fill, dtype=np.uint8)])
        stream, lens = _encode_piece(piece, codes, lengths)
        streams.append(stream)
        chunk_lens.append(lens)
    return np.concatenate(streams), np.concatenate(chunk_lens).astype(np.uint16)


def _encode_piece(piece: np.ndarray, codes: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n_len = lengths[piece].astype(np.int64).reshape(-1, CHUNK)
    chunk_bytes = (n_len.sum(axis=1) + 7) // 8
    chunk_start = np.concatenate([[0], np.cumsum(chunk_bytes)[:-1]]) * 8
    # bit position of every symbol: its chunk's (byte-aligned) start plus the lengths before it
    pos = (np.cumsum(n_len, axis=1) - n_len + chunk_start[:, None]).ravel()
    n_len = n_len.ravel()
    # place each code in the 24-bit window starting at its first byte; codes never share a bit, so
    # summing the three byte contributions per byte position is the same as OR-ing them
    window = codes[piece].astype(np.int64) << (24 - (pos & 7) - n_len)
    first = pos >> 3
    total = int(chunk_bytes.sum()) + 2
    out = np.zeros(total, dtype=np.float64)
    for k, shift in enumerate((16, 8, 0)):
        out += np.bincount(first + k, weights=(window >> shift) & 0xFF, minlength=total)
    return out[: total - 2].astype(np.uint8), chunk_bytes


def decode(stream: np.ndarray, chunk_lens: np.ndarray, count: int, lengths: np.ndarray) -> np.ndarray:
    """Decode `count` symbols from `encode`'s output."""
    tables = decode_tables(lengths)
    n_chunks = len(chunk_lens)
    if n_chunks * CHUNK < count:
        raise ValueError(f"{n_chunks} chunks cannot hold {count} symbols")
    starts = np.concatenate([[0], np.cumsum(chunk_lens, dtype=np.int64)[:-1]])
    if n_chunks and int(starts[-1]) + int(chunk_lens[-1]) != len(stream):
        raise ValueError("chunk lengths do not add up to the stream length")
    padded = np.concatenate([stream, np.zeros(4, dtype=np.uint8)])
    # big-endian 32-bit word starting at every byte (a strided view, no copy)
    words = np.ndarray(shape=(len(stream) + 1,), dtype=">u4", buffer=padded, strides=(1,))
    out = np.empty((n_chunks, CHUNK), dtype=np.uint8)
    # a slab of chunks at a time: its part of the stream stays in cache for all CHUNK steps
    for first in range(0, n_chunks, _SLAB):
        out[first : first + _SLAB] = _decode_slab(words, starts[first : first + _SLAB] * 8, tables).T
    return out.reshape(-1)[:count]


def _decode_slab(words: np.ndarray, pos: np.ndarray, tables: tuple[np.ndarray, np.ndarray]) -> np.ndarray:
    sym_table, len_table = tables
    out = np.empty((CHUNK, len(pos)), dtype=np.uint8)
    mask = (1 << MAX_LEN) - 1
    for step in range(CHUNK):
        w = words[pos >> 3].astype(np.int64)
        window = (w >> (32 - MAX_LEN - (pos & 7))) & mask
        out[step] = sym_table[window]
        pos += len_table[window]
    return out
