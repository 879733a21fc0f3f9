// bf16 products y[M, N] = x[M, K] @ W[N, K]^T of float (bf16) models' linear layers, W row-major as stored
// (nn.Linear's weight, the tied embedding: no second copy), fp32 sums, into fp32 or bf16.
//
// On AVX512-BF16 every call goes to bf16_tiles.cpp (register tiles of `vdpbf16ps`, one summation order
// for every row count; kernels/bf16.py decides which products call). Below that, these decode-step loops,
// one weight row at a time against up to four activation rows (two with AVX2):
//
//   avx512 / avx2: weights widened to fp32 by a 16-bit shift (bf16 is the top half of an fp32), FMA
//                  against the activations converted to fp32 once;
//   scalar:      the same sums in plain loops (any CPU).
//
// Each thread reads its rows one after another, each row start to end (a few independent sums per
// activation row, so the dot product is not one dependency chain): its whole share of W is one sequential
// stream, the pattern the hardware prefetcher follows best. Reading several rows side by side, with or
// without software prefetches of the next ones into L1, breaks that stream and runs slower. bf16_tiles.cpp
// reads rows side by side again, with the next tile prefetched into L2 instead, which outruns both.
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
constexpr int kM = 4;     // activation rows per tile (AVX2, with half the registers: 2)
constexpr int kU = 4;     // independent sums per activation row, so a row's dot product is not one chain
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
// Helpers of the AVX-512 variant (the base set's target, so that it inlines them).
template <int MB, int U>
EDGEINFER_TARGET_AVX512_BASE inline void zero(__m512 (&acc)[MB][U]) {
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
}

// The sum of one activation row's accumulators, in a fixed order.
template <int U>
EDGEINFER_TARGET_AVX512_BASE inline float total(const __m512 (&acc)[U]) {
  __m512 s = acc[0];
  for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[u]);
  return _mm512_reduce_add_ps(s);
}

template <int MB, int R>
EDGEINFER_TARGET_AVX512 void tile_avx512(const Operands& op, const uint16_t* w, int64_t m0, float* y,
                                         int64_t ldy) {
  const int64_t k = op.k, body = k - k % (16 * kU);
  const float* x = op.xf + m0 * k;
  for (int r = 0; r < R; ++r) {
    const uint16_t* wr = w + r * k;
    __m512 acc[MB][kU];
    zero(acc);
    int64_t i = 0;
    for (; i < body; i += 16 * kU)
      for (int u = 0; u < kU; ++u) {
        const __m512 wv = edgeinfer_cpu::bf16x16_to_fp32(wr + i + 16 * u);
        for (int m = 0; m < MB; ++m)
          acc[m][u] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * k + i + 16 * u), acc[m][u]);
      }
    for (; i < k; i += 16) {
      const __mmask16 mask = k - i >= 16 ? 0xFFFF : (1u << (k - i)) - 1;
      const __m512 wv = edgeinfer_cpu::bf16x16_to_fp32(wr + i, mask);
      for (int m = 0; m < MB; ++m)
        acc[m][0] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * k + i), acc[m][0]);
    }
    for (int m = 0; m < MB; ++m) y[m * ldy + r] = total(acc[m]);
  }
}

EDGEINFER_TARGET_AVX2 inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

EDGEINFER_TARGET_AVX2 inline __m256 widen8(const uint16_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

template <int MB, int R>
EDGEINFER_TARGET_AVX2 void tile_avx2(const Operands& op, const uint16_t* w, int64_t m0, float* y, int64_t ldy) {
  const int64_t k = op.k, body = k - k % (8 * kU), whole = k & ~int64_t{7};
  const float* x = op.xf + m0 * k;
  for (int r = 0; r < R; ++r) {
    const uint16_t* wr = w + r * k;
    __m256 acc[MB][kU];
    for (auto& row : acc)
      for (auto& a : row) a = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i < body; i += 8 * kU)
      for (int u = 0; u < kU; ++u) {
        const __m256 wv = widen8(wr + i + 8 * u);
        for (int m = 0; m < MB; ++m)
          acc[m][u] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * k + i + 8 * u), acc[m][u]);
      }
    for (; i < whole; i += 8) {
      const __m256 wv = widen8(wr + i);
      for (int m = 0; m < MB; ++m) acc[m][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * k + i), acc[m][0]);
    }
    for (int m = 0; m < MB; ++m) {
      __m256 sum = acc[m][0];
      for (int u = 1; u < kU; ++u) sum = _mm256_add_ps(sum, acc[m][u]);
      float s = hsum8(sum);
      for (int64_t j = whole; j < k; ++j) s += bf16_bits_to_float(wr[j]) * x[m * k + j];
      y[m * ldy + r] = s;
    }
  }
}
#endif

// Tile functions of one variant, indexed [MB - 1][R - 1]; a variant with fewer registers stops at 2 rows.
#define EDGEINFER_ROW(fn, mb) {fn<mb, 1>, fn<mb, 2>, fn<mb, 3>, fn<mb, 4>, fn<mb, 5>, fn<mb, 6>, fn<mb, 7>, fn<mb, 8>}
#define EDGEINFER_TABLE(fn) \
  std::array<std::array<TileFn, kRows>, kM> { \
    { EDGEINFER_ROW(fn, 1), EDGEINFER_ROW(fn, 2), EDGEINFER_ROW(fn, 3), EDGEINFER_ROW(fn, 4) } \
  }
#define EDGEINFER_TABLE_2(fn) \
  std::array<std::array<TileFn, kRows>, kM> { \
    { EDGEINFER_ROW(fn, 1), EDGEINFER_ROW(fn, 2) } \
  }

using Tiles = std::array<std::array<TileFn, kRows>, kM>;

// The variant this call runs (no tiles here: AVX512-BF16, whose kernel is bf16_tiles.cpp), the activation
// rows one tile takes, and whether it reads them in fp32.
struct Variant {
  const Tiles* tiles;
  int64_t rows_per_tile;
  bool wants_fp32;
  const char* name;
};

Variant pick_variant() {
  static const Tiles scalar = EDGEINFER_TABLE(tile_scalar);
#if EDGEINFER_X86
  static const Tiles avx512 = EDGEINFER_TABLE(tile_avx512);
  static const Tiles avx2 = EDGEINFER_TABLE_2(tile_avx2);  // 16 ymm registers: 2 rows x kU sums
  if (edgeinfer_cpu::isa_allows(Isa::kAvx512Bf16)) return {nullptr, 0, false, "avx512_bf16"};  // bf16_tiles.cpp
  if (edgeinfer_cpu::isa_allows(Isa::kAvx512)) return {&avx512, kM, true, "avx512"};
  if (edgeinfer_cpu::isa_allows(Isa::kAvx2)) return {&avx2, 2, true, "avx2"};
#endif
  return {&scalar, kM, true, "scalar"};
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
#if EDGEINFER_X86
  if (v.tiles == nullptr) return bf16_tiles_out(xc, w, out);
#endif
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
      for (int64_t m0 = 0; m0 < m_rows; m0 += v.rows_per_tile) {
        const int64_t mb = std::min<int64_t>(v.rows_per_tile, m_rows - m0);
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
