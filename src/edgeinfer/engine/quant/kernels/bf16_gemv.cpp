// bf16 matrix-vector products for decode steps of float (bf16) models: y[M, N] = x[M, K] @ W[N, K]^T.
//
// A one-sequence decode step reads every weight once, so its speed is how fast the weights stream from
// memory. torch's bf16 GEMV on CPU reaches a fraction of that on wide matrices (the 262k x 640 Gemma
// lm_head); these read W row-major as stored (nn.Linear's weight, the tied embedding: no second copy),
// eight weight rows against up to two activation rows at a time, with fp32 sums:
//
//   avx512_bf16: `vdpbf16ps`, 32 bf16 products per instruction, on the bf16 operands as they are;
//   avx512 / avx2: weights widened to fp32 by a 16-bit shift (bf16 is the top half of an fp32), FMA
//                  against the activations converted to fp32 once;
//   scalar:      the same sums in plain loops (any CPU).
//
// Each tile prefetches the next tile's weights (the rows below it, at the offset it is reading): one core
// has too few cache misses in flight for the hardware prefetcher alone to reach the memory bandwidth, and
// a tile's rows are short streams (Gemma's 640 inputs: 1,280 B a row) that it barely learns before they
// end. Measured on the 262k x 640 lm_head at 2 threads (AMD EPYC, AVX512-BF16, interleaved medians of 15,
// three runs; a plain streaming read of the same bytes alongside): read 54 GB/s -> each row 512 B ahead
// 32.3 GB/s, next tile 42.9 (Gemma's layer shapes 28.7 -> 35.2); at a busier hour read 35-36 GB/s ->
// 29.4-31.2 vs 32.1-32.4. Two tiles ahead measured the same as one. Earlier, on an Intel Xeon at 2
// threads (plain read 29.5-31.7 GB/s): 4 rows, no prefetch 19.2 GB/s; 8 rows, 512 B ahead 24.9; 256 B
// 24.7; 1 KiB 19.3; 16 rows 22.4-24.0.
//
// The variant is picked per call from what the CPU reports (isa.h). Rows are split across the engine's
// threads in chunks of at least kGrainBytes of weight, so small layers are not spread over more threads
// than their size repays.

#include "isa.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using edgeinfer_cpu::Isa;

constexpr int kRows = 8;  // weight rows per tile
constexpr int kM = 2;     // activation rows per tile
constexpr int64_t kGrainBytes = 64 * 1024;

using edgeinfer_cpu::bf16_bits_to_float;

// The operands of one product: weights and activations as raw bf16 bits, the activations also in fp32
// for the variants that widen the weights.
struct Operands {
  const uint16_t* w;
  const uint16_t* x;
  const float* xf;
  int64_t k;
};

// One tile: weight rows [0, R) x activation rows [0, MB) -> y[m * ldy + r] (fp32 sums).
using TileFn = void (*)(const Operands&, const uint16_t* w, int64_t m0, float* y, int64_t ldy);

template <int MB, int R>
void tile_scalar(const Operands& op, const uint16_t* w, int64_t m0, float* y, int64_t ldy) {
  for (int m = 0; m < MB; ++m) {
    const float* x = op.xf + (m0 + m) * op.k;
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
      for (int64_t i = 0; i < op.k; ++i) s += bf16_bits_to_float(w[r * op.k + i]) * x[i];
      y[m * ldy + r] = s;
    }
  }
}

#if EDGEINFER_X86
// The next tile's rows at input `i` (past the last tile: prefetches never fault). No target attribute:
// `prefetcht0` is baseline x86-64, and each variant inlines this.
template <int R>
inline void prefetch_next_tile(const uint16_t* w, int64_t k, int64_t i) {
  for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + (R + r) * k + i), _MM_HINT_T0);
}

template <int MB, int R>
EDGEINFER_TARGET_BF16 inline void step_bf16(__m512 (&acc)[MB][R], const uint16_t* w, const uint16_t* x, int64_t k,
                                            int64_t i, __mmask32 mask) {
  __m512bh wv[R];
  for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * k + i);
  for (int m = 0; m < MB; ++m) {
    const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * k + i);
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
  }
}

template <int MB, int R>
EDGEINFER_TARGET_BF16 void tile_avx512_bf16(const Operands& op, const uint16_t* w, int64_t m0, float* y,
                                             int64_t ldy) {
  const int64_t k = op.k, body = k & ~int64_t{31};
  const uint16_t* x = op.x + m0 * k;
  __m512 acc[MB][R];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < body; i += 32) {
    prefetch_next_tile<R>(w, k, i);
    step_bf16<MB, R>(acc, w, x, k, i, ~__mmask32{0});
  }
  if (body < k) step_bf16<MB, R>(acc, w, x, k, body, (__mmask32{1} << (k - body)) - 1);  // masked lanes add 0
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <int MB, int R>
EDGEINFER_TARGET_AVX512 void tile_avx512(const Operands& op, const uint16_t* w, int64_t m0, float* y,
                                         int64_t ldy) {
  const int64_t k = op.k;
  const float* x = op.xf + m0 * k;
  __m512 acc[MB][R];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t i = 0; i < k; i += 16) {
    const __mmask16 mask = k - i >= 16 ? 0xFFFF : (1u << (k - i)) - 1;
    if (i % 32 == 0) prefetch_next_tile<R>(w, k, i);
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = edgeinfer_cpu::bf16x16_to_fp32(w + r * k + i, mask);
    for (int m = 0; m < MB; ++m) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * k + i);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = _mm512_reduce_add_ps(acc[m][r]);
}

EDGEINFER_TARGET_AVX2 inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

template <int MB, int R>
EDGEINFER_TARGET_AVX2 void tile_avx2(const Operands& op, const uint16_t* w, int64_t m0, float* y, int64_t ldy) {
  const int64_t k = op.k, body = k & ~int64_t{7};
  const float* x = op.xf + m0 * k;
  __m256 acc[MB][R];
  for (auto& row : acc)
    for (auto& a : row) a = _mm256_setzero_ps();
  for (int64_t i = 0; i < body; i += 8) {
    if (i % 32 == 0) prefetch_next_tile<R>(w, k, i);
    __m256 wv[R];
    for (int r = 0; r < R; ++r) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + r * k + i));
      wv[r] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
    }
    for (int m = 0; m < MB; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * k + i);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm256_fmadd_ps(wv[r], xv, acc[m][r]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) {
      float s = hsum8(acc[m][r]);
      for (int64_t i = body; i < k; ++i) s += bf16_bits_to_float(w[r * k + i]) * x[m * k + i];
      y[m * ldy + r] = s;
    }
}
#endif

// Tile functions of one variant, indexed [MB - 1][R - 1].
#define EDGEINFER_ROW(fn, mb) {fn<mb, 1>, fn<mb, 2>, fn<mb, 3>, fn<mb, 4>, fn<mb, 5>, fn<mb, 6>, fn<mb, 7>, fn<mb, 8>}
#define EDGEINFER_TABLE(fn) \
  std::array<std::array<TileFn, kRows>, kM> { \
    { EDGEINFER_ROW(fn, 1), EDGEINFER_ROW(fn, 2) } \
  }

using Tiles = std::array<std::array<TileFn, kRows>, kM>;

// The variant this call runs, and whether it reads the activations in fp32.
struct Variant {
  const Tiles* tiles;
  bool wants_fp32;
  const char* name;
};

Variant pick_variant() {
  static const Tiles scalar = EDGEINFER_TABLE(tile_scalar);
#if EDGEINFER_X86
  static const Tiles bf16 = EDGEINFER_TABLE(tile_avx512_bf16);
  static const Tiles avx512 = EDGEINFER_TABLE(tile_avx512);
  static const Tiles avx2 = EDGEINFER_TABLE(tile_avx2);
  if (edgeinfer_cpu::isa_allows(Isa::kAvx512Bf16)) return {&bf16, false, "avx512_bf16"};
  if (edgeinfer_cpu::isa_allows(Isa::kAvx512)) return {&avx512, true, "avx512"};
  if (edgeinfer_cpu::isa_allows(Isa::kAvx2)) return {&avx2, true, "avx2"};
#endif
  return {&scalar, true, "scalar"};
}

void check(const at::Tensor& x, const at::Tensor& w, const at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_gemv: x must be bf16 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(1) == x.size(1),
              "bf16_gemv: w must be bf16 [N, K]");
  TORCH_CHECK(w.is_contiguous(), "bf16_gemv: w must be contiguous");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == w.size(0) && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "bf16_gemv: out must be contiguous fp32 or bf16 [M, N]");
}

void store(const float* sums, int64_t mb, int64_t rows, at::Tensor& out, int64_t m0, int64_t n0) {
  const int64_t n = out.size(1);
  if (out.scalar_type() == at::kFloat) {
    float* o = out.data_ptr<float>();
    for (int64_t m = 0; m < mb; ++m) std::memcpy(o + (m0 + m) * n + n0, sums + m * kRows, rows * sizeof(float));
    return;
  }
  at::BFloat16* o = out.data_ptr<at::BFloat16>();
  for (int64_t m = 0; m < mb; ++m)
    for (int64_t r = 0; r < rows; ++r) o[(m0 + m) * n + n0 + r] = at::BFloat16(sums[m * kRows + r]);
}

}  // namespace

namespace edgeinfer_cpu {

void bf16_gemv_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  check(x, w, out);
  const int64_t m_rows = x.size(0), n = w.size(0), k = w.size(1);
  if (m_rows == 0 || n == 0) return;
  const at::Tensor xc = x.contiguous();
  const Variant v = pick_variant();
  const at::Tensor xf = v.wants_fp32 ? xc.to(at::kFloat) : at::Tensor();
  const Operands op{reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                    reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()),
                    v.wants_fp32 ? xf.data_ptr<float>() : nullptr, k};
  const int64_t blocks = (n + kRows - 1) / kRows;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kRows * k * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    float sums[kM * kRows];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kRows, rows = std::min<int64_t>(kRows, n - n0);
      for (int64_t m0 = 0; m0 < m_rows; m0 += kM) {
        const int64_t mb = std::min<int64_t>(kM, m_rows - m0);
        (*v.tiles)[mb - 1][rows - 1](op, op.w + n0 * k, m0, sums, kRows);
        store(sums, mb, rows, out, m0, n0);
      }
    }
  });
}

at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w) {
  auto out = at::empty({x.size(0), w.size(0)}, x.options());
  bf16_gemv_out(x, w, out);
  return out;
}

}  // namespace edgeinfer_cpu

namespace {

std::string bf16_variant() { return pick_variant().name; }

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def("bf16_gemv(Tensor x, Tensor w) -> Tensor");
  m.def("bf16_gemv_out(Tensor x, Tensor w, Tensor(a!) out) -> ()");
  m.def("bf16_variant() -> str", bf16_variant);
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) {
  m.impl("bf16_gemv", edgeinfer_cpu::bf16_gemv);
  m.impl("bf16_gemv_out", edgeinfer_cpu::bf16_gemv_out);
}
