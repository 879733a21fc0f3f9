// Quantized matmuls for x86 CPUs that multiply integer codes, built at first use by kernels/__init__.py.
//
// At one sequence a decode step is a string of matrix-vector products, bound by how fast the weights
// stream from memory. torch's kernels for them convert every weight to float before multiplying (int4)
// or pack a second copy of the weight (fbgemm, int8). These multiply integer codes by int8 activation
// codes with AVX512-VNNI (`vpdpbusd`: 64 u8 x s8 products summed into 16 int32 lanes per instruction),
// so the work per weight byte is a load, a mask and a fraction of one instruction.
//
//   int8_gemv:  int8 codes [N, K] (row-major: the same buffer the embedding lookup and `_int_mm` read) x
//               per-token int8 activation codes. The int32 sums are exact and the epilogue scales by the
//               weight scale then the token scale, so the result is bit for bit `_int_mm`'s.
//   int8_gemv_kn: the same for weights stored [K, N] (layers with more inputs than outputs).
//   int4_gemv:  4-bit codes in a row-tiled layout (int4_pack), group-wise scales and zero terms, x
//               activations quantized here per group of the weight's group size (as llama.cpp's Q8_0
//               blocks): W4A8. The group sums are exact int32; the float zero term is applied once a group.
//
// Each variant is compiled with its own target attribute (isa.h): AVX512-VNNI where the CPU reports it;
// on AVX2-only CPUs the same integer sums in 256-bit registers (`vpmaddubsw` / `vpmaddwd`, llama.cpp's
// AVX2 path does the same); elsewhere plain loops. All three give the same int32 sums and run the same
// float epilogue, so their results are bit for bit equal.

#include "isa.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

namespace {

bool use_vnni() { return EDGEINFER_X86 && edgeinfer_cpu::isa_allows(edgeinfer_cpu::Isa::kAvx512Vnni); }

// The integer kernels' variants, best first.
enum class Path { kVnni, kAvx2, kRef };

Path int_path() {
  if (use_vnni()) return Path::kVnni;
  if (EDGEINFER_X86 && edgeinfer_cpu::isa_allows(edgeinfer_cpu::Isa::kAvx2)) return Path::kAvx2;
  return Path::kRef;
}

constexpr int64_t kTile = 16;  // int4 rows per tile: one int32 lane each
constexpr int64_t kSlab = 8;   // int4 inputs per 64-byte slab of a tile (low nibbles 0-3, high 4-7)
constexpr int64_t kRowBlock = 4;  // activation rows that share one pass over a weight tile

// ---------------------------------------------------------------------------------------------
// int8 x int8, row-major weights

// Sum of int8 codes of one activation row: `vpdpbusd` wants an unsigned operand, so the weights are
// offset by 128 and 128 * sum(a) is taken back out.
int32_t code_sum(const int8_t* a, int64_t k) {
  int32_t s = 0;
  for (int64_t i = 0; i < k; ++i) s += a[i];
  return s;
}

#if EDGEINFER_X86
EDGEINFER_TARGET_VNNI int32_t dot_u8w_s8a(const int8_t* w, const int8_t* a, int64_t k) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i acc0 = _mm512_setzero_si512(), acc1 = _mm512_setzero_si512();
  int64_t i = 0;
  for (; i + 128 <= k; i += 128) {
    __m512i w0 = _mm512_xor_si512(_mm512_loadu_si512(w + i), flip);
    __m512i w1 = _mm512_xor_si512(_mm512_loadu_si512(w + i + 64), flip);
    acc0 = _mm512_dpbusd_epi32(acc0, w0, _mm512_loadu_si512(a + i));
    acc1 = _mm512_dpbusd_epi32(acc1, w1, _mm512_loadu_si512(a + i + 64));
  }
  for (; i < k; i += 64) {
    // a masked-off weight byte reads 0 and flips to 128, against an activation byte of 0: adds nothing
    const __mmask64 m = k - i >= 64 ? ~0ULL : (1ULL << (k - i)) - 1;
    __m512i w0 = _mm512_xor_si512(_mm512_maskz_loadu_epi8(m, w + i), flip);
    acc0 = _mm512_dpbusd_epi32(acc0, w0, _mm512_maskz_loadu_epi8(m, a + i));
  }
  return _mm512_reduce_add_epi32(_mm512_add_epi32(acc0, acc1));
}

EDGEINFER_TARGET_AVX2 inline int32_t hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

EDGEINFER_TARGET_AVX2 inline __m256i widen16(const int8_t* p) {
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// Both operands sign-extended to int16 and multiplied in pairs (`vpmaddwd`): exact for every int8 value,
// where `vpmaddubsw` would need one operand unsigned and saturate at -128 x -128 pairs.
EDGEINFER_TARGET_AVX2 int32_t dot_s8_avx2(const int8_t* w, const int8_t* a, int64_t k) {
  __m256i acc0 = _mm256_setzero_si256(), acc1 = _mm256_setzero_si256();
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    acc0 = _mm256_add_epi32(acc0, _mm256_madd_epi16(widen16(w + i), widen16(a + i)));
    acc1 = _mm256_add_epi32(acc1, _mm256_madd_epi16(widen16(w + i + 16), widen16(a + i + 16)));
  }
  int32_t s = hsum_epi32(_mm256_add_epi32(acc0, acc1));
  for (; i < k; ++i) s += int32_t(w[i]) * int32_t(a[i]);
  return s;
}
#endif

int32_t dot_i8(const int8_t* w, const int8_t* a, int64_t k, int32_t a_sum, Path path) {
#if EDGEINFER_X86
  if (path == Path::kVnni) return dot_u8w_s8a(w, a, k) - 128 * a_sum;
  if (path == Path::kAvx2) return dot_s8_avx2(w, a, k);
#endif
  int32_t s = 0;
  for (int64_t i = 0; i < k; ++i) s += int32_t(w[i]) * int32_t(a[i]);
  return s;
}

void check_int8(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& w, const at::Tensor& w_scale) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar, "int8_gemv: xq must be int8 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.size(1) == xq.size(1),
              "int8_gemv: w must be int8 [N, K]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == w.size(0), "int8_gemv: w_scale");
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat && x_scale.numel() == xq.size(0), "int8_gemv: x_scale");
}

// The contiguous operands of an int8 product, and each activation row's code sum (for the offset).
struct Int8Operands {
  at::Tensor a, w, w_scale, x_scale;
  std::vector<int32_t> sums;

  Int8Operands(const at::Tensor& xq, const at::Tensor& xs, const at::Tensor& wq, const at::Tensor& ws)
      : a(xq.contiguous()), w(wq.contiguous()), w_scale(ws.contiguous()), x_scale(xs.contiguous()),
        sums(xq.size(0)) {
    const int64_t k = xq.size(1);
    for (int64_t m = 0; m < xq.size(0); ++m) sums[m] = code_sum(a.data_ptr<int8_t>() + m * k, k);
  }
};

void int8_gemv_out(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& w,
                   const at::Tensor& w_scale, at::Tensor& out) {
  check_int8(xq, x_scale, w, w_scale);
  const int64_t m_rows = xq.size(0), n = w.size(0), k = w.size(1);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 && out.size(0) == m_rows &&
              out.size(1) == n, "int8_gemv_out: out must be contiguous fp32 [M, N]");
  const Int8Operands ops(xq, x_scale, w, w_scale);
  const int8_t* ap = ops.a.data_ptr<int8_t>();
  const int8_t* wp = ops.w.data_ptr<int8_t>();
  const float* wsp = ops.w_scale.data_ptr<float>();
  const float* xsp = ops.x_scale.data_ptr<float>();
  const int32_t* sums = ops.sums.data();
  float* op = out.data_ptr<float>();
  const Path path = int_path();
  at::parallel_for(0, n, 1024, [&](int64_t n0, int64_t n1) {
    for (int64_t j = n0; j < n1; ++j) {
      for (int64_t m = 0; m < m_rows; ++m) {
        const int32_t d = dot_i8(wp + j * k, ap + m * k, k, sums[m], path);
        // float(int32) * weight scale * token scale: `_int_mm`'s epilogue, in its order
        op[m * n + j] = static_cast<float>(d) * wsp[j] * xsp[m];
      }
    }
  });
}

at::Tensor int8_gemv(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& w,
                     const at::Tensor& w_scale) {
  check_int8(xq, x_scale, w, w_scale);
  auto out = at::empty({xq.size(0), w.size(0)}, xq.options().dtype(at::kFloat));
  int8_gemv_out(xq, x_scale, w, w_scale, out);
  return out;
}

// ---------------------------------------------------------------------------------------------
// int8 x int8, [K, N] weights
//
// Layers with more inputs than outputs keep W^T row-major (`_int_mm`'s fast operand there, quant/int8.py),
// so four consecutive inputs of one output are N bytes apart. Four input rows of a block of 64 outputs are
// interleaved in registers (`unpack` within 128-bit lanes) so that int32 lane j of register q holds
// W[k..k+3] of output 16 * (j / 4) + 4 * q + j % 4 of the block: one `vpdpbusd` against the broadcast
// activation codes a[k..k+3] advances 16 outputs by four inputs. Same offset trick and epilogue as above,
// so the result is again bit for bit `_int_mm`'s.

constexpr int64_t kKnBlock = 64;  // outputs per block
constexpr int64_t kKnRows = 4;    // activation rows per pass over a block (16 accumulators)

void check_int8_kn(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& w, const at::Tensor& w_scale) {
  TORCH_CHECK(xq.dim() == 2 && xq.scalar_type() == at::kChar, "int8_gemv_kn: xq must be int8 [M, K]");
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar && w.size(0) == xq.size(1),
              "int8_gemv_kn: w must be int8 [K, N]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == w.size(1), "int8_gemv_kn: w_scale");
  TORCH_CHECK(x_scale.scalar_type() == at::kFloat && x_scale.numel() == xq.size(0), "int8_gemv_kn: x_scale");
}

// Exact int32 sums of rows [m0, m0 + rows) against outputs [n0, n0 + 64) into acc[r * 64 + o]. `quads`:
// each activation row's codes as int32 words of four, zero-padded to `k4 = ceil(k / 4)` words.
#if EDGEINFER_X86
EDGEINFER_TARGET_VNNI void kn_block_vnni(const int8_t* w, int64_t n, int64_t k, int64_t n0, const int8_t* a,
                                         const int32_t* quads, int64_t m0, int64_t rows, const int32_t* a_sums,
                                         int32_t* acc) {
  (void)a;
  const int64_t width = std::min(kKnBlock, n - n0);
  const __mmask64 mask = width == kKnBlock ? ~0ULL : (1ULL << width) - 1;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  __m512i sums[kKnRows][4];
  for (auto& row : sums)
    for (auto& v : row) v = _mm512_setzero_si512();
  for (int64_t i = 0; i < k; i += 4) {
    __m512i r[4];
    for (int64_t j = 0; j < 4; ++j)  // past the last input: weight 128 against activation 0, adds nothing
      r[j] = i + j < k ? _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, w + (i + j) * n + n0), flip) : flip;
    const __m512i t0 = _mm512_unpacklo_epi8(r[0], r[1]), t1 = _mm512_unpackhi_epi8(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi8(r[2], r[3]), t3 = _mm512_unpackhi_epi8(r[2], r[3]);
    const __m512i v[4] = {_mm512_unpacklo_epi16(t0, t2), _mm512_unpackhi_epi16(t0, t2),
                          _mm512_unpacklo_epi16(t1, t3), _mm512_unpackhi_epi16(t1, t3)};
    const int64_t k4 = (k + 3) / 4;
    for (int64_t rr = 0; rr < rows; ++rr) {
      const __m512i b = _mm512_set1_epi32(quads[(m0 + rr) * k4 + i / 4]);
      for (int q = 0; q < 4; ++q) sums[rr][q] = _mm512_dpbusd_epi32(sums[rr][q], v[q], b);
    }
  }
  alignas(64) int32_t lanes[4][16];
  for (int64_t rr = 0; rr < rows; ++rr) {
    for (int q = 0; q < 4; ++q) _mm512_store_si512(lanes[q], sums[rr][q]);
    for (int64_t j = 0; j < 16; ++j)
      for (int64_t q = 0; q < 4; ++q)
        acc[rr * kKnBlock + 16 * (j / 4) + 4 * q + j % 4] = lanes[q][j] - 128 * a_sums[m0 + rr];
  }
}
#endif

// The same sums in 256-bit registers. Two input rows of 16 outputs are sign-extended to int16 and
// interleaved (`unpack` within 128-bit lanes), so one `vpmaddwd` against the broadcast pair a[i], a[i+1]
// advances 8 outputs by two inputs. `quads` here holds each row's codes as int16 pairs, zero-padded to
// `ceil(k / 2)` words; no offset trick (`a_sums` unused).
#if EDGEINFER_X86
EDGEINFER_TARGET_AVX2 void kn_block_avx2(const int8_t* w, int64_t n, int64_t k, int64_t n0, const int8_t* a,
                                         const int32_t* quads, int64_t m0, int64_t rows, const int32_t* a_sums,
                                         int32_t* acc) {
  (void)a;
  (void)a_sums;
  const int64_t width = std::min(kKnBlock, n - n0), k2 = (k + 1) / 2;
  alignas(32) int8_t edge[2][16] = {};
  alignas(32) int32_t lanes[2][8];
  for (int64_t c = 0; c < width; c += 16) {
    const int64_t cw = std::min<int64_t>(16, width - c);
    __m256i sums[kKnRows][2];
    for (auto& row : sums) row[0] = row[1] = _mm256_setzero_si256();
    for (int64_t i = 0; i < k; i += 2) {
      const int8_t* r0 = w + i * n + n0 + c;
      const int8_t* r1 = i + 1 < k ? r0 + n : nullptr;
      if (cw < 16) {  // a partial chunk reads its outputs through a zero-padded copy
        std::memcpy(edge[0], r0, cw);
        if (r1) std::memcpy(edge[1], r1, cw);
        r0 = edge[0];
      }
      const __m256i v0 = widen16(r0);
      const __m256i v1 = r1 ? widen16(cw < 16 ? edge[1] : r1) : _mm256_setzero_si256();
      const __m256i lo = _mm256_unpacklo_epi16(v0, v1), hi = _mm256_unpackhi_epi16(v0, v1);
      for (int64_t rr = 0; rr < rows; ++rr) {
        const __m256i b = _mm256_set1_epi32(quads[(m0 + rr) * k2 + i / 2]);
        sums[rr][0] = _mm256_add_epi32(sums[rr][0], _mm256_madd_epi16(lo, b));
        sums[rr][1] = _mm256_add_epi32(sums[rr][1], _mm256_madd_epi16(hi, b));
      }
    }
    for (int64_t rr = 0; rr < rows; ++rr) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[0]), sums[rr][0]);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes[1]), sums[rr][1]);
      // lo holds outputs 0-3 and 8-11 of the chunk, hi 4-7 and 12-15
      for (int64_t j = 0; j < 8; ++j) {
        const int64_t o = c + (j / 4) * 8 + j % 4;
        acc[rr * kKnBlock + o] = lanes[0][j];
        acc[rr * kKnBlock + o + 4] = lanes[1][j];
      }
    }
  }
}
#endif

// The same sums in plain loops (no offset trick: `quads` and `a_sums` are unused).
void kn_block_ref(const int8_t* w, int64_t n, int64_t k, int64_t n0, const int8_t* a, const int32_t* quads,
                  int64_t m0, int64_t rows, const int32_t* a_sums, int32_t* acc) {
  const int64_t width = std::min(kKnBlock, n - n0);
  (void)a_sums;
  (void)quads;
  std::fill(acc, acc + rows * kKnBlock, 0);
  for (int64_t rr = 0; rr < rows; ++rr)
    for (int64_t i = 0; i < k; ++i) {
      const int32_t x = a[(m0 + rr) * k + i];
      for (int64_t o = 0; o < width; ++o) acc[rr * kKnBlock + o] += x * int32_t(w[i * n + n0 + o]);
    }
}

// Each activation row's codes as int32 words of four (VNNI) or of two int16 (AVX2), zero-padded.
std::vector<int32_t> code_quads(const int8_t* a, int64_t m_rows, int64_t k) {
  const int64_t k4 = (k + 3) / 4;
  std::vector<int32_t> quads(m_rows * k4, 0);
  for (int64_t m = 0; m < m_rows; ++m) std::memcpy(quads.data() + m * k4, a + m * k, k);
  return quads;
}

std::vector<int32_t> code_pairs(const int8_t* a, int64_t m_rows, int64_t k) {
  const int64_t k2 = (k + 1) / 2;
  std::vector<int32_t> pairs(m_rows * k2, 0);
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t i = 0; i < k; ++i) {
      const uint32_t half = static_cast<uint16_t>(static_cast<int16_t>(a[m * k + i]));
      pairs[m * k2 + i / 2] |= static_cast<int32_t>(half << (16 * (i % 2)));
    }
  return pairs;
}

at::Tensor int8_gemv_kn(const at::Tensor& xq, const at::Tensor& x_scale, const at::Tensor& w,
                        const at::Tensor& w_scale) {
  check_int8_kn(xq, x_scale, w, w_scale);
  const int64_t m_rows = xq.size(0), k = w.size(0), n = w.size(1);
  auto out = at::empty({m_rows, n}, xq.options().dtype(at::kFloat));
  const Int8Operands ops(xq, x_scale, w, w_scale);
  const int8_t* ap = ops.a.data_ptr<int8_t>();
  const int8_t* wp = ops.w.data_ptr<int8_t>();
  const float* wsp = ops.w_scale.data_ptr<float>();
  const float* xsp = ops.x_scale.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const Path path = int_path();
  const std::vector<int32_t> quads = path == Path::kAvx2 ? code_pairs(ap, m_rows, k) : code_quads(ap, m_rows, k);
  const int64_t blocks = (n + kKnBlock - 1) / kKnBlock;
  using KnBlockFn = void (*)(const int8_t*, int64_t, int64_t, int64_t, const int8_t*, const int32_t*, int64_t,
                             int64_t, const int32_t*, int32_t*);
#if EDGEINFER_X86
  const KnBlockFn kn_block = path == Path::kVnni ? kn_block_vnni : path == Path::kAvx2 ? kn_block_avx2 : kn_block_ref;
#else
  const KnBlockFn kn_block = kn_block_ref;
#endif
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    std::vector<int32_t> acc(kKnRows * kKnBlock);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kKnBlock, width = std::min(kKnBlock, n - n0);
      for (int64_t m0 = 0; m0 < m_rows; m0 += kKnRows) {
        const int64_t rows = std::min(kKnRows, m_rows - m0);
        kn_block(wp, n, k, n0, ap, quads.data(), m0, rows, ops.sums.data(), acc.data());
        for (int64_t rr = 0; rr < rows; ++rr)
          for (int64_t o = 0; o < width; ++o)  // `_int_mm`'s epilogue order, as int8_gemv
            op[(m0 + rr) * n + n0 + o] = static_cast<float>(acc[rr * kKnBlock + o]) * wsp[n0 + o] * xsp[m0 + rr];
      }
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// int4 x int8, row-tiled weights
//
// Layout (int4_pack): for each tile of 16 rows, K/8 slabs of 64 bytes; byte 4r + j of slab s holds row r's
// codes for inputs 8s + j (low nibble) and 8s + 4 + j (high nibble). So one 64-byte load, masked and
// shifted, gives two registers whose int32 lane r holds four consecutive codes of row r: one `vpdpbusd`
// against four broadcast activation codes advances all 16 rows by four inputs.
// Scales and zero terms: bf16 [N/16, K/G, 16]. The weight is (q - 8) * scale + zero_term, as in torch's
// int4 CPU layout, so sum(w * a) = scale * (sum(q * a) - 8 sum(a)) + zero_term * sum(a) per group.

struct ActGroups {
  std::vector<int8_t> q;    // [M, K] codes
  std::vector<float> scale;  // [M, K/G]
  std::vector<int32_t> sum;  // [M, K/G]: sum of codes, for the zero term
};

#if EDGEINFER_X86
// One group of bf16 activations, as the scalar loop below computes it: the max of |x| (order-free, and a
// NaN ignored as std::max ignores it), codes rounded half to even, and their exact sum.
EDGEINFER_TARGET_AVX512 void quantize_group_avx512(const uint16_t* xb, int64_t g, int8_t* qb, float* scale,
                                                   int32_t* sum) {
  __m512 mx = _mm512_setzero_ps();
  for (int64_t i = 0; i < g; i += 16) mx = _mm512_max_ps(_mm512_abs_ps(edgeinfer_cpu::bf16x16_to_fp32(xb + i)), mx);
  const float s = _mm512_reduce_max_ps(mx) / 127.f;
  const __m512 inv = _mm512_set1_ps(s > 0.f ? 1.f / s : 0.f);
  const __m512 lo = _mm512_set1_ps(-127.f), hi = _mm512_set1_ps(127.f);
  __m512i acc = _mm512_setzero_si512();
  for (int64_t i = 0; i < g; i += 16) {
    const __m512 v = _mm512_roundscale_ps(_mm512_mul_ps(edgeinfer_cpu::bf16x16_to_fp32(xb + i), inv),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(hi, _mm512_max_ps(lo, v)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + i), _mm512_cvtepi32_epi8(q));
    acc = _mm512_add_epi32(acc, q);
  }
  *scale = s;
  *sum = _mm512_reduce_add_epi32(acc);
}
#endif

template <typename T>
ActGroups quantize_groups(const T* x, int64_t m_rows, int64_t k, int64_t g) {
  const int64_t ng = k / g;
  ActGroups a{std::vector<int8_t>(m_rows * k), std::vector<float>(m_rows * ng), std::vector<int32_t>(m_rows * ng)};
#if EDGEINFER_X86
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (g % 16 == 0 && edgeinfer_cpu::isa_allows(edgeinfer_cpu::Isa::kAvx512)) {
      const auto* xb = reinterpret_cast<const uint16_t*>(x);
      for (int64_t m = 0; m < m_rows; ++m)
        for (int64_t b = 0; b < ng; ++b)
          quantize_group_avx512(xb + m * k + b * g, g, a.q.data() + m * k + b * g, &a.scale[m * ng + b],
                                &a.sum[m * ng + b]);
      return a;
    }
  }
#endif
  for (int64_t m = 0; m < m_rows; ++m) {
    for (int64_t b = 0; b < ng; ++b) {
      const T* xb = x + m * k + b * g;
      float amax = 0.f;
      for (int64_t i = 0; i < g; ++i) amax = std::max(amax, std::fabs(static_cast<float>(xb[i])));
      const float s = amax / 127.f;
      const float inv = s > 0.f ? 1.f / s : 0.f;
      int32_t sum = 0;
      int8_t* qb = a.q.data() + m * k + b * g;
      for (int64_t i = 0; i < g; ++i) {
        const float v = std::nearbyint(static_cast<float>(xb[i]) * inv);
        qb[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, v)));
        sum += qb[i];
      }
      a.scale[m * ng + b] = s;
      a.sum[m * ng + b] = sum;
    }
  }
  return a;
}

using edgeinfer_cpu::bf16_bits_to_float;

// One tile of 16 rows against `mb` (<= kRowBlock) activation rows; writes out[m][16]. `mb` and the group
// size are template arguments so that the loops unroll and the accumulators live in registers.
#if EDGEINFER_X86
template <int64_t mb, int64_t g>
EDGEINFER_TARGET_VNNI void int4_tile_vnni(const uint8_t* codes, const uint16_t* scales, const uint16_t* zero_terms,
                                          int64_t k, const ActGroups& a, int64_t m0, float* out) {
  constexpr int64_t slabs = g / kSlab;
  const int64_t ng = k / g;
  const int8_t* aq = a.q.data() + m0 * k;
  const float* as = a.scale.data() + m0 * ng;
  const int32_t* asum = a.sum.data() + m0 * ng;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[mb];
  for (int64_t m = 0; m < mb; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0; b < ng; ++b) {
    // two accumulators per row (low / high nibbles): `vpdpbusd` has a latency of several cycles, and with
    // four rows eight chains keep it busy. The low one starts at -8 sum(a): sum((q - 8) * a) = sum(q * a)
    // - 8 sum(a), exact in int32, with no subtraction after the loop.
    __m512i dot[mb][2];
    for (int64_t m = 0; m < mb; ++m) {
      dot[m][0] = _mm512_set1_epi32(-8 * asum[m * ng + b]);
      dot[m][1] = _mm512_setzero_si512();
    }
    const uint8_t* cb = codes + b * slabs * 64;
    for (int64_t s = 0; s < slabs; ++s) {
      const __m512i v = _mm512_loadu_si512(cb + s * 64);
      const __m512i lo = _mm512_and_si512(v, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
      const int64_t i = b * g + s * kSlab;
      for (int64_t m = 0; m < mb; ++m) {
        int32_t q03, q47;
        std::memcpy(&q03, aq + m * k + i, 4);
        std::memcpy(&q47, aq + m * k + i + 4, 4);
        dot[m][0] = _mm512_dpbusd_epi32(dot[m][0], lo, _mm512_set1_epi32(q03));
        dot[m][1] = _mm512_dpbusd_epi32(dot[m][1], hi, _mm512_set1_epi32(q47));
      }
    }
    const __m512 sc = edgeinfer_cpu::bf16x16_to_fp32(scales + b * kTile);
    const __m512 zt = edgeinfer_cpu::bf16x16_to_fp32(zero_terms + b * kTile);
    for (int64_t m = 0; m < mb; ++m) {
      // scale the exact sum, add zero_term * sum(a)
      const int32_t sum_a = asum[m * ng + b];
      const __m512i c = _mm512_add_epi32(dot[m][0], dot[m][1]);
      const __m512 part = _mm512_fmadd_ps(_mm512_cvtepi32_ps(c), sc, _mm512_mul_ps(zt, _mm512_set1_ps(static_cast<float>(sum_a))));
      acc[m] = _mm512_fmadd_ps(part, _mm512_set1_ps(as[m * ng + b]), acc[m]);
    }
  }
  for (int64_t m = 0; m < mb; ++m) _mm512_storeu_ps(out + m * kTile, acc[m]);
}
#endif

// The same sums in 256-bit registers, one half-tile of 8 rows at a time (32 bytes of each slab):
// `vpmaddubsw` multiplies the u8 codes by the s8 activation codes in pairs into int16, and four slabs of
// them (at most 4 x 2 x 2 x 15 x 128 < 2^15 in magnitude: no saturation) are summed before `vpmaddwd`
// widens them to int32. The float epilogue is the VNNI variant's, in its order.
#if EDGEINFER_X86
EDGEINFER_TARGET_AVX2 inline __m256 bf16x8_to_fp32(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

template <int64_t mb, int64_t g>
EDGEINFER_TARGET_AVX2 void int4_tile_avx2(const uint8_t* codes, const uint16_t* scales, const uint16_t* zero_terms,
                                          int64_t k, const ActGroups& a, int64_t m0, float* out) {
  constexpr int64_t slabs = g / kSlab, run = 4;
  static_assert(slabs % run == 0, "whole runs of slabs per group");
  const int64_t ng = k / g;
  const int8_t* aq = a.q.data() + m0 * k;
  const float* as = a.scale.data() + m0 * ng;
  const int32_t* asum = a.sum.data() + m0 * ng;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  for (int64_t h = 0; h < 2; ++h) {
    __m256 acc[mb];
    for (int64_t m = 0; m < mb; ++m) acc[m] = _mm256_setzero_ps();
    for (int64_t b = 0; b < ng; ++b) {
      __m256i dot[mb];
      for (int64_t m = 0; m < mb; ++m) dot[m] = _mm256_setzero_si256();
      const uint8_t* cb = codes + b * slabs * 64 + 32 * h;
      for (int64_t s0 = 0; s0 < slabs; s0 += run) {
        __m256i pairs[mb];
        for (int64_t m = 0; m < mb; ++m) pairs[m] = _mm256_setzero_si256();
        for (int64_t s = s0; s < s0 + run; ++s) {
          const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(cb + s * 64));
          const __m256i lo = _mm256_and_si256(v, low);
          const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
          const int64_t i = b * g + s * kSlab;
          for (int64_t m = 0; m < mb; ++m) {
            int32_t q03, q47;
            std::memcpy(&q03, aq + m * k + i, 4);
            std::memcpy(&q47, aq + m * k + i + 4, 4);
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_set1_epi32(q03)),
                                               _mm256_maddubs_epi16(hi, _mm256_set1_epi32(q47)));
            pairs[m] = _mm256_add_epi16(pairs[m], p);
          }
        }
        for (int64_t m = 0; m < mb; ++m) dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(pairs[m], ones));
      }
      const __m256 sc = bf16x8_to_fp32(scales + b * kTile + 8 * h);
      const __m256 zt = bf16x8_to_fp32(zero_terms + b * kTile + 8 * h);
      for (int64_t m = 0; m < mb; ++m) {
        const int32_t sum_a = asum[m * ng + b];
        const __m256i c = _mm256_sub_epi32(dot[m], _mm256_set1_epi32(8 * sum_a));
        const __m256 part =
            _mm256_fmadd_ps(_mm256_cvtepi32_ps(c), sc, _mm256_mul_ps(zt, _mm256_set1_ps(static_cast<float>(sum_a))));
        acc[m] = _mm256_fmadd_ps(part, _mm256_set1_ps(as[m * ng + b]), acc[m]);
      }
    }
    for (int64_t m = 0; m < mb; ++m) _mm256_storeu_ps(out + m * kTile + 8 * h, acc[m]);
  }
}
#endif

// The same arithmetic in plain loops.
template <int64_t mb, int64_t g>
void int4_tile_ref(const uint8_t* codes, const uint16_t* scales, const uint16_t* zero_terms, int64_t k,
                   const ActGroups& a, int64_t m0, float* out) {
  constexpr int64_t slabs = g / kSlab;
  const int64_t ng = k / g;
  const int8_t* aq = a.q.data() + m0 * k;
  const float* as = a.scale.data() + m0 * ng;
  const int32_t* asum = a.sum.data() + m0 * ng;
  for (int64_t m = 0; m < mb; ++m) {
    float acc[kTile] = {};
    for (int64_t b = 0; b < ng; ++b) {
      const int64_t ag = m * ng + b;
      for (int64_t r = 0; r < kTile; ++r) {
        int32_t dot = 0;
        for (int64_t s = 0; s < slabs; ++s) {
          const uint8_t* slab = codes + (b * slabs + s) * 64 + 4 * r;
          const int8_t* q = aq + m * k + b * g + s * kSlab;
          for (int64_t j = 0; j < 4; ++j) dot += (slab[j] & 15) * q[j] + (slab[j] >> 4) * q[4 + j];
        }
        const int32_t c = dot - 8 * asum[ag];
        const float part = std::fma(static_cast<float>(c), bf16_bits_to_float(scales[b * kTile + r]),
                                 bf16_bits_to_float(zero_terms[b * kTile + r]) * static_cast<float>(asum[ag]));
        acc[r] = std::fma(part, as[ag], acc[r]);
      }
    }
    std::memcpy(out + m * kTile, acc, sizeof acc);
  }
}

using TileFn = void (*)(const uint8_t*, const uint16_t*, const uint16_t*, int64_t, const ActGroups&, int64_t, float*);

template <int64_t mb, int64_t g>
TileFn pick_variant(Path path) {
#if EDGEINFER_X86
  if (path == Path::kVnni) return int4_tile_vnni<mb, g>;
  if (path == Path::kAvx2) return int4_tile_avx2<mb, g>;
#endif
  return int4_tile_ref<mb, g>;
}

template <int64_t mb>
TileFn pick_group(int64_t g, Path path) {
  switch (g) {
    case 32: return pick_variant<mb, 32>(path);
    case 64: return pick_variant<mb, 64>(path);
    case 128: return pick_variant<mb, 128>(path);
    default: TORCH_CHECK(false, "int4_gemv: group size ", g, " is not 32, 64 or 128");
  }
}

TileFn pick_tile(int64_t mb, int64_t g, Path path) {
  switch (mb) {
    case 1: return pick_group<1>(g, path);
    case 2: return pick_group<2>(g, path);
    case 3: return pick_group<3>(g, path);
    default: return pick_group<4>(g, path);
  }
}

// One weight tile (16 output columns from `col`) against activation rows [m_begin, m_end), in blocks of
// kRowBlock rows: the same blocks, so the same sums, wherever the rows sit in `a`. Writes out[m * n + col + r].
template <typename Out>
void tile_rows(TileFn full, int64_t group, Path path, const uint8_t* ct, const uint16_t* st, const uint16_t* zt,
               int64_t k, const ActGroups& a, int64_t m_begin, int64_t m_end, int64_t n, int64_t col, Out* out) {
  float buf[kRowBlock * kTile];
  for (int64_t m0 = m_begin; m0 < m_end; m0 += kRowBlock) {
    const int64_t mb = std::min(kRowBlock, m_end - m0);
    (mb == kRowBlock ? full : pick_tile(mb, group, path))(ct, st, zt, k, a, m0, buf);
    for (int64_t m = 0; m < mb; ++m)
      for (int64_t r = 0; r < kTile; ++r) out[(m0 + m) * n + col + r] = static_cast<Out>(buf[m * kTile + r]);
  }
}

}  // namespace

namespace edgeinfer_cpu {

at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& zero_terms, int64_t group) {
  TORCH_CHECK(x.dim() == 2, "int4_gemv: x must be [M, K]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "int4_gemv: x fp32 or bf16");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.size(2) == 64,
              "int4_gemv: codes must be uint8 [N/16, K/8, 64]");
  const int64_t m_rows = x.size(0), k = x.size(1), tiles = codes.size(0), n = tiles * kTile;
  TORCH_CHECK(group % kSlab == 0 && k % group == 0 && codes.size(1) * kSlab == k, "int4_gemv: shapes");
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.numel() == n * (k / group), "int4_gemv: scales");
  TORCH_CHECK(zero_terms.scalar_type() == at::kBFloat16 && zero_terms.numel() == n * (k / group), "int4_gemv: zero terms");
  const auto xc = x.contiguous();
  const auto cc = codes.contiguous();
  const auto sc = scales.contiguous();
  const auto zc = zero_terms.contiguous();
  const ActGroups a = x.scalar_type() == at::kFloat
      ? quantize_groups(xc.data_ptr<float>(), m_rows, k, group)
      : quantize_groups(xc.data_ptr<at::BFloat16>(), m_rows, k, group);
  auto out = at::empty({m_rows, n}, x.options());
  const uint8_t* cp = cc.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zc.data_ptr<at::BFloat16>());
  const int64_t ng = k / group;
  float* of = x.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  at::BFloat16* ob = of ? nullptr : out.data_ptr<at::BFloat16>();
  const Path path = int_path();
  const TileFn full = pick_tile(kRowBlock, group, path);  // checks the group size before the threads start
  at::parallel_for(0, tiles, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* ct = cp + t * (k / kSlab) * 64;
      const uint16_t* st = sp + t * ng * kTile;
      const uint16_t* zt = zp + t * ng * kTile;
      if (of) tile_rows(full, group, path, ct, st, zt, k, a, 0, m_rows, n, t * kTile, of);
      else tile_rows(full, group, path, ct, st, zt, k, a, 0, m_rows, n, t * kTile, ob);
    }
  });
  return out;
}

at::Tensor int4_gemv_grouped(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& zero_terms, const std::vector<int64_t>& start, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "int4_gemv_grouped: x must be contiguous bf16 [R, K]");
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte && codes.size(3) == 64 && codes.is_contiguous(),
              "int4_gemv_grouped: codes must be contiguous uint8 [E, N/16, K/8, 64]");
  const int64_t experts = codes.size(0), k = x.size(1), tiles = codes.size(1), n = tiles * kTile;
  TORCH_CHECK(group % kSlab == 0 && k % group == 0 && codes.size(2) * kSlab == k, "int4_gemv_grouped: shapes");
  const int64_t ng = k / group;
  TORCH_CHECK(scales.is_contiguous() && zero_terms.is_contiguous() && scales.numel() == experts * n * ng &&
                  zero_terms.numel() == scales.numel(),
              "int4_gemv_grouped: scales and zero terms must be contiguous [E, N/16, K/G, 16]");
  TORCH_CHECK(static_cast<int64_t>(start.size()) == experts + 1 && start.front() == 0 && start.back() == x.size(0),
              "int4_gemv_grouped: start must hold E + 1 row offsets, from 0 to R");
  std::vector<int64_t> used;  // the experts with rows
  for (int64_t e = 0; e < experts; ++e) {
    TORCH_CHECK(start[e] <= start[e + 1], "int4_gemv_grouped: row offsets must not decrease");
    if (start[e + 1] > start[e]) used.push_back(e);
  }
  const ActGroups a = quantize_groups(x.data_ptr<at::BFloat16>(), x.size(0), k, group);
  auto out = at::empty({x.size(0), n}, x.options());
  at::BFloat16* ob = out.data_ptr<at::BFloat16>();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
  const uint16_t* zp = reinterpret_cast<const uint16_t*>(zero_terms.data_ptr<at::BFloat16>());
  const int64_t codes_per_expert = tiles * (k / kSlab) * 64, groups_per_expert = tiles * ng * kTile;
  const Path path = int_path();
  const TileFn full = pick_tile(kRowBlock, group, path);
  // every (expert, tile) in one parallel region; within a unit, the expert's rows as int4_gemv takes them
  const int64_t units = static_cast<int64_t>(used.size()) * tiles;
  at::parallel_for(0, units, 16, [&](int64_t u0, int64_t u1) {
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t e = used[u / tiles], t = u % tiles;
      tile_rows(full, group, path, cp + e * codes_per_expert + t * (k / kSlab) * 64,
                sp + e * groups_per_expert + t * ng * kTile, zp + e * groups_per_expert + t * ng * kTile, k, a,
                start[e], start[e + 1], n, t * kTile, ob);
    }
  });
  return out;
}

}  // namespace edgeinfer_cpu

namespace {

std::string isa() { return edgeinfer_cpu::isa_name(); }

void set_isa_cap(const std::string& name) { edgeinfer_cpu::set_isa_cap(name); }

}  // namespace

TORCH_LIBRARY(edgeinfer_cpu, m) {
  m.def("int8_gemv(Tensor xq, Tensor x_scale, Tensor w, Tensor w_scale) -> Tensor");
  m.def("int8_gemv_out(Tensor xq, Tensor x_scale, Tensor w, Tensor w_scale, Tensor(a!) out) -> ()");
  m.def("int8_gemv_kn(Tensor xq, Tensor x_scale, Tensor w, Tensor w_scale) -> Tensor");
  m.def("int4_gemv(Tensor x, Tensor codes, Tensor scales, Tensor zero_terms, int group) -> Tensor");
  m.def("isa() -> str", isa);
  m.def("set_isa_cap(str name) -> ()", set_isa_cap);
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) {
  m.impl("int8_gemv", int8_gemv);
  m.impl("int8_gemv_out", int8_gemv_out);
  m.impl("int8_gemv_kn", int8_gemv_kn);
  m.impl("int4_gemv", edgeinfer_cpu::int4_gemv);
}
