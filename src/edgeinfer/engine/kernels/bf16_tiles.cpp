// bf16 products y[M, N] = x[M, K] @ W[N, K]^T on AVX512-BF16, for any number of rows: decode steps of
// one sequence or of many (kernels/bf16.py sends products of up to 64 rows; torch's GEMM is as fast on
// wider ones).
//
// `vdpbf16ps` multiplies 32 bf16 pairs into 16 fp32 lanes. Every output is one chain of these over K (a
// masked last chunk where K is not a multiple of 32), then its 16 lanes summed by halving (8, 4, 2, 1
// apart). That order is the same whatever tile computes the output, so a row's result does not depend on
// the batch it came in or on the threads (batched = unbatched, bit for bit).
//
// A tile holds 16 accumulators: MB activation rows x NB weight rows (4 x 4; where fewer than 4 rows are
// left, 3 x 5 or 2 x 8), side by side, so that per 32 inputs MB + NB loads feed MB x NB products (4 x 4:
// 8 loads, 16 products); one transpose-add tree sums all 16 (~3 instructions an output, against K / 32
// products). Work is split over threads by blocks of kBlock weight rows (a multiple of every NB); a task
// walks each block once per chunk of activation rows that stays in L1 (kL1Bytes), each weight tile
// reused by the chunk's tiles. A single activation row (one sequence's decode step, bound by the weight
// stream) reads its 16 weight rows one after another instead, each start to end: one sequential stream.
//
// Prefetch: side by side, the first pass over a block (activation rows from 0) fetches the next weight
// tile into L2 (`prefetcht1`, a line per row per 32 inputs) while it multiplies this one. That is what
// takes the weight stream to the memory bandwidth: prefetching into L1 instead (`prefetcht0`) leaves the
// wider products no faster than no prefetch at all, and fetching further ahead than the next tile gains
// nothing. At one row the side-by-side reads cost more than reading the rows in order, hence the
// in-order reading of a single row above (timings: docs/engine.md, docs/benchmarks.md). A caller whose
// weight block sits in its own buffer (lossless_gemv.cpp) has the tiles fetch other bytes instead, paced
// over all of the block's 4 x 4 tiles: its next block's compressed form.

#include "isa.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#if EDGEINFER_X86
namespace {

constexpr int kAcc = 16;
constexpr int64_t kBlock = 80;
constexpr int64_t kGrainBytes = 64 * 1024;
constexpr int64_t kL1Bytes = 16 * 1024;  // activation rows a chunk of tiles keeps in L1

using edgeinfer_cpu::bf16_bits;
using edgeinfer_cpu::sum_lanes16;

struct Product {
  const uint16_t* x;
  const uint16_t* w;
  int64_t m, n, k;
  float* out_f32;  // one of the two outputs, [m, n] in rows `ldo` apart
  at::BFloat16* out_bf16;
  int64_t ldo;
};

// A tile's sums (lane m * nb_tile + n: activation row m0 + m, weight row n0 + n) into rows [m0, m0 + mb) x
// [n0, n0 + nb) of the output: row m's lanes by a masked store at out - m * nb_tile.
EDGEINFER_TARGET_BF16 inline void store(const Product& p, __m512 sums, int64_t m0, int64_t mb, int64_t n0,
                                        int64_t nb, int nb_tile) {
  for (int64_t m = 0; m < mb; ++m) {
    const int64_t at = (m0 + m) * p.ldo + n0 - m * nb_tile;
    const __mmask16 lanes = static_cast<__mmask16>(((1u << nb) - 1) << (m * nb_tile));
    if (p.out_f32)
      _mm512_mask_storeu_ps(p.out_f32 + at, lanes, sums);
    else
      _mm256_mask_storeu_epi16(p.out_bf16 + at, lanes, bf16_bits(sums));
  }
}

// What a tile fetches into L2 as it goes, one `step` per 32 inputs: nothing; the next NB weight rows
// (a line per row per step); or another weight's bytes, paced (Paced).
struct NoFetch {
  void step(int64_t) {}
};

template <int NB>
struct NextTile {
  const uint16_t* next;
  int64_t k;
  EDGEINFER_TARGET_BF16 void step(int64_t i) {
#pragma GCC unroll 16
    for (int n = 0; n < NB; ++n) _mm_prefetch(reinterpret_cast<const char*>(next + n * k + i), _MM_HINT_T1);
  }
};

// The bytes of `Ahead`, `per` lines every `every` steps, so that they are in L2 by the end of `steps`.
class Paced {
 public:
  Paced(const edgeinfer_cpu::Ahead& ahead, int64_t steps) : ahead_(ahead) {
    int64_t lines = 0;
    for (int s = 0; s < 3; ++s) lines += (ahead_.end[s] - ahead_.begin[s] + 63) / 64;
    steps = std::max<int64_t>(1, steps);
    per_ = std::max<int64_t>(1, (lines + steps - 1) / steps);
    every_ = std::max<int64_t>(1, steps / std::max<int64_t>(1, lines));
  }

  void step(int64_t) {
    if (++count_ < every_) return;
    count_ = 0;
    for (int64_t j = 0; j < per_; ++j) {
      while (span_ < 3 && ahead_.begin[span_] >= ahead_.end[span_]) ++span_;
      if (span_ == 3) return;
      _mm_prefetch(ahead_.begin[span_], _MM_HINT_T1);
      ahead_.begin[span_] += 64;
    }
  }

 private:
  edgeinfer_cpu::Ahead ahead_;
  int64_t per_ = 1, every_ = 1, count_ = 0;
  int span_ = 0;
};

// Outputs of activation rows [m0, m0 + MB) x weight rows [n0, n0 + NB): one chain each (acc[m * NB + n])
// over K in chunks of 32, the last one masked, `fetch` stepping along. Rows past the end are computed on
// the last row again and not stored.
template <int MB, int NB, class Fetch>
EDGEINFER_TARGET_BF16 void tile(const Product& p, int64_t m0, int64_t n0, Fetch& fetch) {
  static_assert(MB * NB <= kAcc);
  const int64_t k = p.k, mb = std::min<int64_t>(MB, p.m - m0), nb = std::min<int64_t>(NB, p.n - n0);
  const uint16_t* xs[MB];
  const uint16_t* ws[NB];
  for (int m = 0; m < MB; ++m) xs[m] = p.x + (m0 + std::min<int64_t>(m, mb - 1)) * k;
  for (int n = 0; n < NB; ++n) ws[n] = p.w + (n0 + std::min<int64_t>(n, nb - 1)) * k;
  const int64_t body = k & ~int64_t{31};
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (k - body)) - 1);
  __m512 acc[kAcc];
#pragma GCC unroll 16
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < body; i += 32) {
    fetch.step(i);
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
  store(p, sum_lanes16(acc), m0, mb, n0, nb, NB);
}

// One activation row against 16 weight rows read one after another, each start to end (one sequential
// stream): the chains as `tile` runs them, one at a time.
EDGEINFER_TARGET_BF16 void tile_in_order(const Product& p, int64_t m0, int64_t n0) {
  const int64_t k = p.k, nb = std::min<int64_t>(16, p.n - n0);
  const uint16_t* x = p.x + m0 * k;
  const int64_t body = k & ~int64_t{31};
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (k - body)) - 1);
  __m512 acc[kAcc];
#pragma GCC unroll 16
  for (int n = 0; n < 16; ++n) {
    const uint16_t* w = p.w + (n0 + std::min<int64_t>(n, nb - 1)) * k;
    __m512 a = _mm512_setzero_ps();
    for (int64_t i = 0; i < body; i += 32)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512(w + i), (__m512bh)_mm512_loadu_si512(x + i));
    if (tail)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_loadu_epi16(tail, w + body),
                           (__m512bh)_mm512_maskz_loadu_epi16(tail, x + body));
    acc[n] = a;
  }
  store(p, sum_lanes16(acc), m0, 1, n0, nb, 16);
}

// MB x NB tile at (m0, n0); `prefetch`: it fetches the next NB weight rows.
template <int MB, int NB>
EDGEINFER_TARGET_BF16 void tile_at(const Product& p, int64_t m0, int64_t n0, bool prefetch) {
  if (prefetch) {
    NextTile<NB> next{p.w + std::min(n0 + NB, p.n - 1) * p.k, p.k};
    tile<MB, NB>(p, m0, n0, next);
  } else {
    NoFetch none;
    tile<MB, NB>(p, m0, n0, none);
  }
}

// Weight rows [n0, n1) x activation rows [m0, m0 + MB) in MB x NB tiles; `prefetch`: each tile fetches the next.
template <int MB, int NB>
EDGEINFER_TARGET_BF16 void row_of_tiles(const Product& p, int64_t n0, int64_t n1, int64_t m0, bool prefetch) {
  for (int64_t n = n0; n < n1; n += NB) tile_at<MB, NB>(p, m0, n, prefetch);
}

// Weight rows [n0, n1) x every activation row: 4 x 4 tiles over chunks of rows that stay in L1 while the
// block's weight tiles pass by, then the last 1-3 rows. With `paced`, the 4 x 4 tiles fetch its bytes
// instead of the next weight tile.
EDGEINFER_TARGET_BF16 void block(const Product& p, int64_t n0, int64_t n1, Paced* paced) {
  const int64_t full = p.m / 4 * 4;
  const int64_t chunk = std::max<int64_t>(4, kL1Bytes / (p.k * 2) / 4 * 4);
  for (int64_t mc = 0; mc < full; mc += chunk) {
    const int64_t end = std::min(full, mc + chunk);
    for (int64_t n = n0; n < n1; n += 4) {
      for (int64_t m = mc; m < end; m += 4) {
        if (paced != nullptr)
          tile<4, 4>(p, m, n, *paced);
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

}  // namespace

namespace edgeinfer_cpu {

void bf16_tiles_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const Product p{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                  reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                  x.size(0),
                  w.size(0),
                  w.size(1),
                  out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr,
                  out.scalar_type() == at::kFloat ? nullptr : out.data_ptr<at::BFloat16>(),
                  w.size(0)};
  const int64_t blocks = (p.n + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kBlock * p.k * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) block(p, b * kBlock, std::min(p.n, (b + 1) * kBlock), nullptr);
  });
}

void bf16_tiles_rows(const uint16_t* x, int64_t m, const uint16_t* w, int64_t n, int64_t k, float* out_f32,
                     at::BFloat16* out_bf16, int64_t ldo, const Ahead& ahead) {
  Paced paced(ahead, m / 4 * ((n + 3) / 4) * ((k + 31) / 32));
  block(Product{x, w, m, n, k, out_f32, out_bf16, ldo}, 0, n, &paced);
}

}  // namespace edgeinfer_cpu
#endif
