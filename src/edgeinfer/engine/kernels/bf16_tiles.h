// The register tiles of bf16 products y[M, N] = x[M, K] @ W[N, K]^T on AVX512-BF16, for the files that run
// them: bf16_tiles.cpp on bf16 weights, lossless_gemv.cpp on weight rows it decodes.
//
// `vdpbf16ps` multiplies 32 bf16 pairs into 16 fp32 lanes. Every output is one chain of these over K (a
// masked last chunk where K is not a multiple of 32), then its 16 lanes summed by halving (8, 4, 2, 1
// apart). That order is the same whatever tile computes the output, so a row's result does not depend on
// the batch it came in or on the threads (batched = unbatched, bit for bit), nor on the weight's form.
//
// A tile holds 16 accumulators: MB activation rows x NB weight rows (4 x 4; where fewer than 4 rows are
// left, 3 x 5 or 2 x 8), side by side, so that per 32 inputs MB + NB loads feed MB x NB products (4 x 4:
// 8 loads, 16 products); one transpose-add tree sums all 16 (~3 instructions an output, against K / 32
// products). A block of weight rows is walked once per chunk of activation rows that stays in L1
// (kL1Bytes), each weight tile reused by the chunk's tiles. A single activation row (one sequence's
// decode step, bound by the weight stream) reads its 16 weight rows one after another instead, each start
// to end: one sequential stream.
//
// Each step of a tile (32 inputs) also runs a side job (`Side::step`): fetching the next weight tile
// into L2 (NextTile; the first pass over a block, from activation row 0), nothing (NoSide), or the caller's
// own (lossless_gemv.cpp decodes its next block of weight rows). A tile copies the side job into a local
// for its loop and is always inlined into its caller: so the job's state and constants stay in registers
// (as a call of its own, GCC kept them in memory, and the decoding side job cost twice its instructions).
//
// Every function here is compiled with EDGEINFER_TILES_TARGET, which the including file may set to a
// wider target than AVX512-BF16 (before including) so that its side jobs, which use more instructions,
// inline into the tiles. Hence the anonymous namespace: each file gets its own copy for its own target.

#pragma once

#include "isa.h"

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#ifndef EDGEINFER_TILES_TARGET
#define EDGEINFER_TILES_TARGET EDGEINFER_TARGET_BF16
#endif

#if EDGEINFER_X86
namespace {
namespace tiles {

constexpr int kAcc = 16;
constexpr int64_t kL1Bytes = 16 * 1024;  // activation rows a chunk of tiles keeps in L1

struct Product {
  const uint16_t* x;  // [m, k]
  const uint16_t* w;  // [n, k] in rows `ldw` apart
  int64_t m, n, k;
  float* out_f32;  // one of the two outputs, [m, n] in rows `ldo` apart
  at::BFloat16* out_bf16;
  int64_t ldo, ldw;
};

// A tile's sums (lane m * nb_tile + n: activation row m0 + m, weight row n0 + n) into rows [m0, m0 + mb) x
// [n0, n0 + nb) of the output: row m's lanes by a masked store at out - m * nb_tile.
EDGEINFER_TILES_TARGET inline void store(const Product& p, __m512 sums, int64_t m0, int64_t mb, int64_t n0,
                                         int64_t nb, int nb_tile) {
  for (int64_t m = 0; m < mb; ++m) {
    const int64_t at = (m0 + m) * p.ldo + n0 - m * nb_tile;
    const __mmask16 lanes = static_cast<__mmask16>(((1u << nb) - 1) << (m * nb_tile));
    if (p.out_f32)
      _mm512_mask_storeu_ps(p.out_f32 + at, lanes, sums);
    else
      _mm256_mask_storeu_epi16(p.out_bf16 + at, lanes, edgeinfer_cpu::bf16_bits(sums));
  }
}

struct NoSide {
  void step() {}
};

// Fetches the next NB weight rows into L2 (a line per row per step).
template <int NB>
struct NextTile {
  const uint16_t* next;
  int64_t ldw, i = 0;
  EDGEINFER_TILES_TARGET void step() {
#pragma GCC unroll 16
    for (int n = 0; n < NB; ++n) _mm_prefetch(reinterpret_cast<const char*>(next + n * ldw + i), _MM_HINT_T1);
    i += 32;
  }
};

// Outputs of activation rows [m0, m0 + MB) x weight rows [n0, n0 + NB): one chain each (acc[m * NB + n])
// over K in chunks of 32, the last one masked, a step of `side` with each full chunk. Rows past the end are
// computed on the last row again and not stored.
template <int MB, int NB, class Side>
EDGEINFER_TILES_TARGET __attribute__((always_inline)) inline void tile(const Product& p, int64_t m0, int64_t n0,
                                                                       Side& side_job) {
  static_assert(MB * NB <= kAcc);
  Side side = side_job;
  const int64_t k = p.k, mb = std::min<int64_t>(MB, p.m - m0), nb = std::min<int64_t>(NB, p.n - n0);
  const uint16_t* xs[MB];
  const uint16_t* ws[NB];
  for (int m = 0; m < MB; ++m) xs[m] = p.x + (m0 + std::min<int64_t>(m, mb - 1)) * k;
  for (int n = 0; n < NB; ++n) ws[n] = p.w + (n0 + std::min<int64_t>(n, nb - 1)) * p.ldw;
  const int64_t body = k & ~int64_t{31};
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (k - body)) - 1);
  __m512 acc[kAcc];
#pragma GCC unroll 16
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < body; i += 32) {
    side.step();
    __m512bh xv[MB];
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(xs[m] + i);
#pragma GCC unroll 16
    for (int n = 0; n < NB; ++n) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(ws[n] + i);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) acc[m * NB + n] = _mm512_dpbf16_ps(acc[m * NB + n], wv, xv[m]);
    }
  }
  if (tail) {
    __m512bh xv[MB];
#pragma GCC unroll 4
    for (int m = 0; m < MB; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(tail, xs[m] + body);
#pragma GCC unroll 16
    for (int n = 0; n < NB; ++n) {
      const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, ws[n] + body);
#pragma GCC unroll 4
      for (int m = 0; m < MB; ++m) acc[m * NB + n] = _mm512_dpbf16_ps(acc[m * NB + n], wv, xv[m]);
    }
  }
  store(p, edgeinfer_cpu::sum_lanes16(acc), m0, mb, n0, nb, NB);
  side_job = side;
}

// One activation row against 16 weight rows read one after another, each start to end (one sequential
// stream): the chains as `tile` runs them, one at a time.
EDGEINFER_TILES_TARGET inline void tile_in_order(const Product& p, int64_t m0, int64_t n0) {
  const int64_t k = p.k, nb = std::min<int64_t>(16, p.n - n0);
  const uint16_t* x = p.x + m0 * k;
  const int64_t body = k & ~int64_t{31};
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (k - body)) - 1);
  __m512 acc[kAcc];
#pragma GCC unroll 16
  for (int n = 0; n < 16; ++n) {
    const uint16_t* w = p.w + (n0 + std::min<int64_t>(n, nb - 1)) * p.ldw;
    __m512 a = _mm512_setzero_ps();
    for (int64_t i = 0; i < body; i += 32)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
    if (tail)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(tail, w + body),
                           (__m512bh)_mm512_maskz_loadu_epi16(tail, x + body));
    acc[n] = a;
  }
  store(p, edgeinfer_cpu::sum_lanes16(acc), m0, 1, n0, nb, 16);
}

// MB x NB tile at (m0, n0); `prefetch`: it fetches the next NB weight rows.
template <int MB, int NB>
EDGEINFER_TILES_TARGET void tile_at(const Product& p, int64_t m0, int64_t n0, bool prefetch) {
  if (prefetch) {
    NextTile<NB> next{p.w + std::min(n0 + NB, p.n - 1) * p.ldw, p.ldw};
    tile<MB, NB>(p, m0, n0, next);
  } else {
    NoSide none;
    tile<MB, NB>(p, m0, n0, none);
  }
}

// Weight rows [n0, n1) x activation rows [m0, m0 + MB) in MB x NB tiles; `prefetch`: each tile fetches the next.
template <int MB, int NB>
EDGEINFER_TILES_TARGET void row_of_tiles(const Product& p, int64_t n0, int64_t n1, int64_t m0, bool prefetch) {
  for (int64_t n = n0; n < n1; n += NB) tile_at<MB, NB>(p, m0, n, prefetch);
}

// The 4 x 4 tiles `block` runs on weight rows [n0, n1): the steps a side job riding along with them gets.
inline int64_t side_steps(const Product& p, int64_t n0, int64_t n1) {
  return p.m / 4 * ((n1 - n0 + 3) / 4) * (p.k / 32);
}

// Activation rows that `block` walks a block of weight rows with at a time (a multiple of 4).
inline int64_t chunk_rows(const Product& p) { return std::max<int64_t>(4, kL1Bytes / (p.k * 2) / 4 * 4); }

// L1 bytes the 4 x 4 tiles of `block` keep in use: a chunk of activation rows and a weight tile.
inline int64_t tiles_l1_bytes(const Product& p) { return (chunk_rows(p) + 4) * p.k * 2; }

// Weight rows [n0, n1) x every activation row: 4 x 4 tiles over chunks of rows that stay in L1 while the
// block's weight tiles pass by, then the last 1-3 rows. With a `side` job, the 4 x 4 tiles run it instead
// of fetching the next weight tile.
template <class Side = NoSide>
EDGEINFER_TILES_TARGET void block(const Product& p, int64_t n0, int64_t n1, Side* side = nullptr) {
  const int64_t full = p.m / 4 * 4, chunk = chunk_rows(p);
  for (int64_t mc = 0; mc < full; mc += chunk) {
    const int64_t end = std::min(full, mc + chunk);
    for (int64_t n = n0; n < n1; n += 4) {
      for (int64_t m = mc; m < end; m += 4) {
        if (side != nullptr)
          tile<4, 4>(p, m, n, *side);
        else
          tile_at<4, 4>(p, m, n, m == 0);
      }
    }
  }
  switch (p.m - full) {
    case 3: return row_of_tiles<3, 5>(p, n0, n1, full, full == 0);
    case 2: return row_of_tiles<2, 8>(p, n0, n1, full, full == 0);
    case 1:
      for (int64_t n = n0; n < n1; n += 16) tile_in_order(p, full, n);
      return;
    default: return;
  }
}

}  // namespace tiles
}  // namespace
#endif
