// Attention of a packed encoder batch in one call: every sequence attends to all of its own tokens and to
// no others (bidirectional, no mask, no padding).
//
// A pass over short texts (sentence embeddings, 8-64 tokens each) is thousands of tiny attention problems,
// [len x head_dim] x [head_dim x len] per sequence and head. torch's SDPA, called once per run of
// equal-length sequences, spends most of its time around them rather than in their arithmetic. Here each
// (sequence, head) is one task on the engine's threads and stays in L1: K is transposed and V widened to
// fp32 once, queries go a few rows at a time with their scores and outputs in registers, and the
// softmax's exp is a vectorised polynomial.
//
// qkv [T, 3, H, D] (the fused projection's output, bf16 or fp32); cu_seqlens int64 [n + 1], sequence i
// being tokens [cu[i], cu[i + 1]). Returns [T, H, D] in qkv's dtype: fp32 sums, rounded once to bf16.
// The AVX-512 variant runs where the CPU has it (isa.h), else plain loops.

#include "isa.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

using edgeinfer_cpu::Isa;
struct Shape {
  int64_t heads, dim, stride;  // stride: elements per token of qkv (3 * heads * dim)
  float scale;
  bool bf16;
};

// Token t's row of part p (0 q, 1 k, 2 v) for `head`, as fp32.
void load_row(const void* qkv, const Shape& sh, int64_t t, int p, int64_t head, float* out) {
  const int64_t at = t * sh.stride + (p * sh.heads + head) * sh.dim;
  if (sh.bf16)
    for (int64_t d = 0; d < sh.dim; ++d) out[d] = edgeinfer_cpu::bf16_bits_to_float(reinterpret_cast<const uint16_t*>(qkv)[at + d]);
  else
    std::memcpy(out, reinterpret_cast<const float*>(qkv) + at, sh.dim * sizeof(float));
}

// The plain-loop variant, one (sequence, head) at a time: the reference the vector variant is tested
// against, and the path of a CPU without AVX-512.
void attend_scalar(const void* qkv, const Shape& sh, int64_t start, int64_t len, int64_t head, void* out) {
  const int64_t dim = sh.dim;
  std::vector<float> k(len * dim), v(len * dim), q(dim), s(len), o(dim);
  for (int64_t j = 0; j < len; ++j) {
    load_row(qkv, sh, start + j, 1, head, k.data() + j * dim);
    load_row(qkv, sh, start + j, 2, head, v.data() + j * dim);
  }
  for (int64_t i = 0; i < len; ++i) {
    load_row(qkv, sh, start + i, 0, head, q.data());
    float mx = -std::numeric_limits<float>::infinity(), sum = 0.f;
    for (int64_t j = 0; j < len; ++j) {
      float dot = 0.f;
      for (int64_t d = 0; d < dim; ++d) dot += q[d] * k[j * dim + d];
      mx = std::max(mx, s[j] = dot * sh.scale);
    }
    std::fill(o.begin(), o.end(), 0.f);
    for (int64_t j = 0; j < len; ++j) {
      const float p = std::exp(s[j] - mx);
      sum += p;
      for (int64_t d = 0; d < dim; ++d) o[d] += p * v[j * dim + d];
    }
    const int64_t at = ((start + i) * sh.heads + head) * dim;
    for (int64_t d = 0; d < dim; ++d) {
      const float y = o[d] / sum;
      if (sh.bf16)
        reinterpret_cast<c10::BFloat16*>(out)[at + d] = c10::BFloat16(y);
      else
        reinterpret_cast<float*>(out)[at + d] = y;
    }
  }
}

#if EDGEINFER_X86
constexpr int64_t kLanes = 16;     // fp32 lanes of an AVX-512 vector
constexpr int64_t kKeyBlock = 32;  // keys per step of the score loop (two vectors); keys padded to it

// 16 bf16 (or fp32) values of a row as fp32 lanes.
EDGEINFER_TARGET_AVX512 inline __m512 load16(const void* base, int64_t at, bool bf16) {
  if (!bf16) return _mm512_loadu_ps(reinterpret_cast<const float*>(base) + at);
  return edgeinfer_cpu::bf16x16_to_fp32(reinterpret_cast<const uint16_t*>(base) + at);
}

// fp32 lanes stored as bf16, rounded to nearest even as c10::BFloat16 rounds (finite values).
EDGEINFER_TARGET_AVX512 inline void store16(void* base, int64_t at, bool bf16, __m512 y) {
  if (!bf16) return _mm512_storeu_ps(reinterpret_cast<float*>(base) + at, y);
  const __m512i b = _mm512_castps_si512(y);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(base) + at), _mm512_cvtepi32_epi16(r));
}

// e^x for x <= 0: x = n ln2 + r with |r| <= ln2 / 2, e^r by its Taylor series to r^6 (relative error
// below 2e-7), times 2^n by `vscalefps`. Below -87 the result is 0 or a denormal, as the softmax wants.
EDGEINFER_TARGET_AVX512 inline __m512 exp_lanes(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2 in two parts: exact n * hi
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// Scores row s[0, len) -> exp(s - max) in place (the padding after len is left alone); returns 1 / sum.
EDGEINFER_TARGET_AVX512 float softmax_row(float* s, int64_t len) {
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < len; j += kLanes) {
    const __mmask16 m = len - j >= kLanes ? 0xFFFF : (1u << (len - j)) - 1;
    mx = _mm512_mask_max_ps(mx, m, mx, _mm512_loadu_ps(s + j));
  }
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; j += kLanes) {
    const __mmask16 m = len - j >= kLanes ? 0xFFFF : (1u << (len - j)) - 1;
    const __m512 e = exp_lanes(_mm512_sub_ps(_mm512_loadu_ps(s + j), top));
    _mm512_mask_storeu_ps(s + j, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return 1.f / _mm512_reduce_add_ps(sum);
}

// One thread's scratch: K transposed [dim, padded keys] (zeros after len), V [len, dim], R query rows,
// R score rows.
struct Scratch {
  std::vector<float> kt, v, q, s;
};

// One (sequence, head) with a head dim of NV vectors. Queries go R rows at a time so that each key
// and value vector loaded serves R rows: the R x 2 score and R x NV output accumulators stay in
// registers (at most 8 of the 32).
template <int NV>
EDGEINFER_TARGET_AVX512 void attend_avx512(const void* qkv, const Shape& sh, int64_t start, int64_t len,
                                           int64_t head, void* out, Scratch& sc) {
  constexpr int64_t D = NV * kLanes, R = NV <= 2 ? 4 : 8 / NV;
  const int64_t padded = (len + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  sc.kt.resize(D * padded);
  sc.v.resize(len * D);
  sc.q.resize(R * D);
  sc.s.resize(R * padded);
  float* kt = sc.kt.data();
  float* q = sc.q.data();
  float* s = sc.s.data();
  const int64_t k_at = (sh.heads + head) * D, v_at = (2 * sh.heads + head) * D, q_at = head * D;
  alignas(64) float row[D];
  for (int64_t j = 0; j < len; ++j) {
    const int64_t t = (start + j) * sh.stride;
    for (int n = 0; n < NV; ++n) {
      _mm512_store_ps(row + n * kLanes, load16(qkv, t + k_at + n * kLanes, sh.bf16));
      _mm512_storeu_ps(sc.v.data() + j * D + n * kLanes, load16(qkv, t + v_at + n * kLanes, sh.bf16));
    }
    for (int64_t d = 0; d < D; ++d) kt[d * padded + j] = row[d];
  }
  for (int64_t d = 0; d < D; ++d) std::fill(kt + d * padded + len, kt + (d + 1) * padded, 0.f);

  const __m512 scale = _mm512_set1_ps(sh.scale);
  for (int64_t i0 = 0; i0 < len; i0 += R) {
    const int64_t rows = std::min(R, len - i0);
    for (int64_t r = 0; r < R; ++r)
      for (int n = 0; n < NV; ++n)
        _mm512_storeu_ps(q + r * D + n * kLanes,
                         r < rows ? _mm512_mul_ps(scale, load16(qkv, (start + i0 + r) * sh.stride + q_at + n * kLanes, sh.bf16))
                                  : _mm512_setzero_ps());
    for (int64_t j = 0; j < padded; j += kKeyBlock) {
      __m512 a[R][2];
      for (int64_t r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m512 k0 = _mm512_loadu_ps(kt + d * padded + j), k1 = _mm512_loadu_ps(kt + d * padded + j + kLanes);
        for (int64_t r = 0; r < R; ++r) {
          const __m512 qd = _mm512_set1_ps(q[r * D + d]);
          a[r][0] = _mm512_fmadd_ps(qd, k0, a[r][0]);
          a[r][1] = _mm512_fmadd_ps(qd, k1, a[r][1]);
        }
      }
      for (int64_t r = 0; r < R; ++r) {
        _mm512_storeu_ps(s + r * padded + j, a[r][0]);
        _mm512_storeu_ps(s + r * padded + j + kLanes, a[r][1]);
      }
    }
    float inv[R];
    for (int64_t r = 0; r < R; ++r) inv[r] = r < rows ? softmax_row(s + r * padded, len) : 0.f;
    __m512 o[R][NV];
    for (int64_t r = 0; r < R; ++r)
      for (int n = 0; n < NV; ++n) o[r][n] = _mm512_setzero_ps();
    for (int64_t j = 0; j < len; ++j) {
      const float* vj = sc.v.data() + j * D;
      for (int n = 0; n < NV; ++n) {
        const __m512 vn = _mm512_loadu_ps(vj + n * kLanes);
        for (int64_t r = 0; r < R; ++r) o[r][n] = _mm512_fmadd_ps(_mm512_set1_ps(s[r * padded + j]), vn, o[r][n]);
      }
    }
    for (int64_t r = 0; r < rows; ++r)
      for (int n = 0; n < NV; ++n)
        store16(out, ((start + i0 + r) * sh.heads + head) * D + n * kLanes, sh.bf16,
                _mm512_mul_ps(o[r][n], _mm512_set1_ps(inv[r])));
  }
}

using AttendAvx512 = void (*)(const void*, const Shape&, int64_t, int64_t, int64_t, void*, Scratch&);

// The vector variant for this head dim, or null (head dims other than 16, 32, 64, 128 take plain loops).
AttendAvx512 pick_avx512(int64_t dim) {
  if (!edgeinfer_cpu::isa_allows(Isa::kAvx512)) return nullptr;
  switch (dim) {
    case 16: return attend_avx512<1>;
    case 32: return attend_avx512<2>;
    case 64: return attend_avx512<4>;
    case 128: return attend_avx512<8>;
    default: return nullptr;
  }
}
#endif

at::Tensor packed_attention(const at::Tensor& qkv, const at::Tensor& cu_seqlens, double scale) {
  TORCH_CHECK(qkv.dim() == 4 && qkv.size(1) == 3 && qkv.is_contiguous(),
              "packed_attention: qkv must be contiguous [tokens, 3, heads, head_dim]");
  TORCH_CHECK(qkv.scalar_type() == at::kBFloat16 || qkv.scalar_type() == at::kFloat,
              "packed_attention: qkv must be bf16 or fp32");
  TORCH_CHECK(cu_seqlens.scalar_type() == at::kLong && cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 1,
              "packed_attention: cu_seqlens must be int64 [sequences + 1]");
  const at::Tensor cu = cu_seqlens.contiguous();
  const int64_t* bounds = cu.data_ptr<int64_t>();
  const int64_t n = cu.size(0) - 1, tokens = qkv.size(0);
  TORCH_CHECK(bounds[0] == 0 && bounds[n] == tokens, "packed_attention: cu_seqlens must run from 0 to ", tokens);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(bounds[i + 1] > bounds[i], "packed_attention: sequence ", i, " is empty or out of order");
  const Shape sh{qkv.size(2), qkv.size(3), 3 * qkv.size(2) * qkv.size(3), static_cast<float>(scale),
                 qkv.scalar_type() == at::kBFloat16};
  auto out = at::empty({tokens, sh.heads, sh.dim}, qkv.options());
  const void* src = qkv.data_ptr();
  void* dst = out.data_ptr();
#if EDGEINFER_X86
  if (const AttendAvx512 fast = pick_avx512(sh.dim)) {
    at::parallel_for(0, n * sh.heads, 1, [&](int64_t t0, int64_t t1) {
      Scratch sc;
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t seq = t / sh.heads;
        fast(src, sh, bounds[seq], bounds[seq + 1] - bounds[seq], t % sh.heads, dst, sc);
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, n * sh.heads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t seq = t / sh.heads;
      attend_scalar(src, sh, bounds[seq], bounds[seq + 1] - bounds[seq], t % sh.heads, dst);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) { m.def("packed_attention(Tensor qkv, Tensor cu_seqlens, float scale) -> Tensor"); }

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) { m.impl("packed_attention", packed_attention); }
