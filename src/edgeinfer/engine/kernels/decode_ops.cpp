// The small ops of a decode step, one call each instead of a dozen torch ops (with AVX-512, prefill's too).
//
// At one sequence a step of a small model is mostly the cost of calling ops (thousands of torch calls a
// step), not of their arithmetic. These repay a kernel of their own:
//
//   rms_norm:         RMSNorm of bf16 rows in fp32, with either family's rounding (below);
//   rope:             rotary embedding of q or k, halves or interleaved pairs;
//   gated_act:        act(gate) * up of the MLP (16-lane loops with AVX-512, else ATen's kernels);
//   paged_decode_one: write one token's K/V into the paged cache, then attend its query heads over
//                     the sequence's blocks where they lie (no gather into a contiguous copy);
//   paged_decode:     the same attention for a batch of decoding sequences (their K/V written before).
//
// Each rounds where the torch ops they replace round (bf16 matmul outputs, bf16 probabilities), so the
// results match the eager path up to the order of fp32 sums. Sums run on AVX-512 where the CPU has it
// (isa.h), else in plain loops. The attention reads a bf16 cache or an int8 / float8 one (kv_codes.h),
// the codes turned into values in registers: a quantized cache is read at half the bytes, never gathered
// and dequantized into a copy.

#include "isa.h"
#include "kv_codes.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using edgeinfer_cpu::Isa;

using edgeinfer_cpu::bf16_bits_to_float;
#if EDGEINFER_X86
using edgeinfer_cpu::bf16_bits;
using edgeinfer_cpu::round_bf16x16;
using edgeinfer_cpu::sum_lanes16;
#endif

inline float round_bf16(float f) { return static_cast<float>(c10::BFloat16(f)); }

// bf16 row -> fp32 row.
void widen_scalar(const uint16_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_bits_to_float(x[i]);
}

// sum_i a[i] * b[i] over fp32 rows.
float dot_scalar(const float* a, const float* b, int64_t n) {
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[i] += p * x[i].
void axpy_scalar(float p, const float* x, float* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += p * x[i];
}

// y = bf16(x * inv * w), or with `round_first` bf16(bf16(x * inv) * w): norm_row's last loop.
void scale_row_scalar(const float* x, float inv, const float* w, bool round_first, c10::BFloat16* y, int64_t d) {
  for (int64_t i = 0; i < d; ++i)
    y[i] = round_first ? c10::BFloat16(round_bf16(x[i] * inv) * w[i]) : c10::BFloat16(x[i] * inv * w[i]);
}

#if EDGEINFER_X86
EDGEINFER_TARGET_AVX512 float dot_avx512(const float* a, const float* b, int64_t n) {
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
  }
  for (; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1;
    acc0 = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, a + i), _mm512_maskz_loadu_ps(m, b + i), acc0);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}

EDGEINFER_TARGET_AVX512 void widen_avx512(const uint16_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1;
    _mm512_mask_storeu_ps(out + i, m, edgeinfer_cpu::bf16x16_to_fp32(x + i, m));
  }
}

EDGEINFER_TARGET_AVX512 void axpy_avx512(float p, const float* x, float* y, int64_t n) {
  const __m512 pv = _mm512_set1_ps(p);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1;
    _mm512_mask_storeu_ps(y + i, m, _mm512_fmadd_ps(pv, _mm512_maskz_loadu_ps(m, x + i), _mm512_maskz_loadu_ps(m, y + i)));
  }
}

// scale_row_scalar, 16 at a time.
EDGEINFER_TARGET_AVX512 void scale_row_avx512(const float* x, float inv, const float* w, bool round_first,
                                              c10::BFloat16* y, int64_t d) {
  const __m512 iv = _mm512_set1_ps(inv);
  for (int64_t i = 0; i < d; i += 16) {
    const __mmask16 m = d - i >= 16 ? 0xFFFF : (1u << (d - i)) - 1;
    __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, x + i), iv);
    if (round_first) v = round_bf16x16(v);
    _mm256_mask_storeu_epi16(y + i, m, bf16_bits(_mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, w + i))));
  }
}

// rope's halves layout, 16 pairs at a time: the same products and roundings as its scalar loop.
EDGEINFER_TARGET_AVX512 void rotate_halves_avx512(const uint16_t* row, const uint16_t* c, const uint16_t* s,
                                                  int64_t half, c10::BFloat16* y) {
  using edgeinfer_cpu::bf16x16_to_fp32;
  for (int64_t j = 0; j < half; j += 16) {
    const __m512 x1 = bf16x16_to_fp32(row + j), x2 = bf16x16_to_fp32(row + half + j);
    const __m512 ca = bf16x16_to_fp32(c + j), sa = bf16x16_to_fp32(s + j);
    const __m512 cb = bf16x16_to_fp32(c + half + j), sb = bf16x16_to_fp32(s + half + j);
    const __m512 ya = _mm512_sub_ps(round_bf16x16(_mm512_mul_ps(x1, ca)), round_bf16x16(_mm512_mul_ps(x2, sa)));
    const __m512 yb = _mm512_add_ps(round_bf16x16(_mm512_mul_ps(x2, cb)), round_bf16x16(_mm512_mul_ps(x1, sb)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + j), bf16_bits(ya));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + half + j), bf16_bits(yb));
  }
}

// e^x for x <= 0 (softmax scores minus their maximum, activations' e^-|x|): x = n ln2 + r, |r| <= ln2 / 2,
// e^r by its Taylor polynomial to r^6 (error below 2^-23 relative), scaled by 2^n; x clamped at -103.
EDGEINFER_TARGET_AVX512_BASE inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-103.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// act(gate) * up for one row of n values (n a multiple of 16), rounded as the torch ops round: the
// activation to bf16, then the product. gelu (tanh): 0.5 g (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3)));
// silu: g / (1 + e^-g). Both through e^-|y| (so never an overflow), within a few fp32 ulps of ATen's Sleef
// functions: silu's bf16 results come out as ATen's bit for bit; gelu's now and then differ by one bf16
// step (where 1 + tanh(y) cancels for y << 0, both roundings are amplified), by more only near 0.
template <int kAct>
EDGEINFER_TARGET_AVX512 void gated_row_avx512(const uint16_t* gate, const uint16_t* up, int64_t n, c10::BFloat16* y) {
  using edgeinfer_cpu::bf16x16_to_fp32;
  const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 g = bf16x16_to_fp32(gate + i);
    __m512 a;
    if constexpr (kAct == 1) {
      const __m512 inner = _mm512_mul_ps(
          _mm512_set1_ps(0.7978845608028654f),
          _mm512_add_ps(g, _mm512_mul_ps(_mm512_set1_ps(0.044715f), _mm512_mul_ps(_mm512_mul_ps(g, g), g))));
      const __m512 t = exp_nonpositive(_mm512_mul_ps(_mm512_set1_ps(-2.f), _mm512_abs_ps(inner)));
      const __m512 th_abs = _mm512_div_ps(_mm512_sub_ps(one, t), _mm512_add_ps(one, t));  // tanh(|y|)
      const __m512 th = _mm512_mask_sub_ps(th_abs, _mm512_cmp_ps_mask(inner, zero, _CMP_LT_OQ), zero, th_abs);
      a = _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), g), _mm512_add_ps(one, th));
    } else {
      const __m512 s = exp_nonpositive(_mm512_sub_ps(zero, _mm512_abs_ps(g)));  // e^-|g|
      // e^-g: s where g >= 0, 1 / s where g < 0; g / (1 + e^-g)
      const __m512 eneg = _mm512_mask_div_ps(s, _mm512_cmp_ps_mask(g, zero, _CMP_LT_OQ), one, s);
      a = _mm512_div_ps(g, _mm512_add_ps(one, eneg));
    }
    const __m512 prod = _mm512_mul_ps(round_bf16x16(a), bf16x16_to_fp32(up + i));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), bf16_bits(prod));
  }
}

// The same in 256-bit registers, for AVX2-only CPUs; tails in plain loops.
EDGEINFER_TARGET_AVX2 float dot_avx2(const float* a, const float* b, int64_t n) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
  }
  const __m256 acc = _mm256_add_ps(acc0, acc1);
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  float s = _mm_cvtss_f32(h);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

EDGEINFER_TARGET_AVX2 void widen_avx2(const uint16_t* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
  }
  for (; i < n; ++i) out[i] = bf16_bits_to_float(x[i]);
}

EDGEINFER_TARGET_AVX2 void axpy_avx2(float p, const float* x, float* y, int64_t n) {
  const __m256 pv = _mm256_set1_ps(p);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] = std::fma(p, x[i], y[i]);
}
#endif

// A pool row's codes (kv_codes.h) -> their values in fp32, by format.
using Fmt = edgeinfer_cpu::kv::Fmt;
using WidenCodes = void (*)(const uint8_t*, float*, int64_t);

template <void (*W)(const uint16_t*, float*, int64_t)>
void widen_bf16_row(const uint8_t* x, float* out, int64_t n) {
  W(reinterpret_cast<const uint16_t*>(x), out, n);
}

template <Fmt F>
void widen_codes_scalar(const uint8_t* x, float* out, int64_t n) {
  const auto& table = edgeinfer_cpu::kv::code_table<F>();
  for (int64_t i = 0; i < n; ++i) out[i] = table[x[i]];
}

#if EDGEINFER_X86
template <Fmt F>
EDGEINFER_TARGET_AVX512 void widen_codes_avx512(const uint8_t* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = n - i >= 16 ? 0xFFFF : (1u << (n - i)) - 1;
    _mm512_mask_storeu_ps(out + i, m, edgeinfer_cpu::kv::codes16_to_fp32<F>(x + i, m));
  }
}

EDGEINFER_TARGET_AVX2 void widen_int8_avx2(const uint8_t* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x + i)))));
  for (; i < n; ++i) out[i] = static_cast<float>(static_cast<int8_t>(x[i]));
}
#endif

// `bf16_attention`: decode attention through attend_group_bf16 (AVX512-BF16; attend_sequences clears it
// where the head dims do not allow). `codes`: a pool row's values in fp32, indexed by Fmt.
struct Vec {
  void (*widen)(const uint16_t*, float*, int64_t);
  float (*dot)(const float*, const float*, int64_t);
  void (*axpy)(float, const float*, float*, int64_t);
  void (*scale_row)(const float*, float, const float*, bool, c10::BFloat16*, int64_t);
  bool bf16_attention = false;
  std::array<WidenCodes, 4> codes = {widen_bf16_row<widen_scalar>, widen_codes_scalar<Fmt::kInt8>,
                                     widen_codes_scalar<Fmt::kE4m3>, widen_codes_scalar<Fmt::kE5m2>};
};

Vec pick() {
#if EDGEINFER_X86
  if (edgeinfer_cpu::isa_allows(Isa::kAvx512))
    return {widen_avx512,
            dot_avx512,
            axpy_avx512,
            scale_row_avx512,
            edgeinfer_cpu::isa_allows(Isa::kAvx512Bf16),
            {widen_bf16_row<widen_avx512>, widen_codes_avx512<Fmt::kInt8>, widen_codes_avx512<Fmt::kE4m3>,
             widen_codes_avx512<Fmt::kE5m2>}};
  if (edgeinfer_cpu::isa_allows(Isa::kAvx2)) {
    Vec v{widen_avx2, dot_avx2, axpy_avx2, scale_row_scalar};
    v.codes[0] = widen_bf16_row<widen_avx2>;
    v.codes[1] = widen_int8_avx2;
    return v;
  }
#endif
  return {widen_scalar, dot_scalar, axpy_scalar, scale_row_scalar};
}

// ---- RMSNorm ------------------------------------------------------------------------------------------

// y = x / rms(x) * w in fp32, rounded to bf16 once (Gemma: `w` is the fp32 `1 + weight`); with
// `round_first`, the normalised row is rounded to bf16 before the bf16 weight multiplies it, and the
// product rounded again (Llama, Qwen: `weight * norm(x).to(bf16)`).
void norm_row(const uint16_t* x, const float* w, float eps, bool round_first, c10::BFloat16* y, int64_t d,
              const Vec& v, float* buf) {
  v.widen(x, buf, d);
  const float inv = 1.f / std::sqrt(v.dot(buf, buf, d) / static_cast<float>(d) + eps);
  v.scale_row(buf, inv, w, round_first, y, d);
}

}  // namespace

namespace edgeinfer_cpu {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool round_first) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "rms_norm: x must be contiguous bf16");
  const int64_t d = x.size(-1), rows = d ? x.numel() / d : 0;
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d, "rms_norm: weight must be [", d, "]");
  // the weight as fp32 values: Gemma's scale is fp32 already, a bf16 weight widens exactly
  const at::Tensor w = weight.to(at::kFloat).contiguous();
  auto out = at::empty_like(x);
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  auto* yp = out.data_ptr<at::BFloat16>();
  const float* wp = w.data_ptr<float>();
  const Vec v = pick();
  const auto e = static_cast<float>(eps);
  // rows of a decode step run on the calling thread: a parallel region costs more than they do
  at::parallel_for(0, rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(d, 1)), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(d);
    for (int64_t r = r0; r < r1; ++r) norm_row(xp + r * d, wp, e, round_first, yp + r * d, d, v, buf.data());
  });
  return out;
}

// ---- Rotary embedding ---------------------------------------------------------------------------

// x [T, H, D] rotated in its first `rd` channels by bf16 cos/sin [T, 1, rd] (halves: HF's rotate_half,
// the tables repeated per half) or [T, 1, rd / 2] (interleaved pairs), each product and the sum rounded
// to bf16 as the torch ops round them.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rd, bool interleaved) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && x.dim() == 3, "rope: x must be bf16 [T, heads, dim]");
  TORCH_CHECK(cos.scalar_type() == at::kBFloat16 && sin.scalar_type() == at::kBFloat16, "rope: bf16 tables");
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2), half = rd / 2, width = interleaved ? half : rd;
  TORCH_CHECK(rd % 2 == 0 && rd <= d, "rope: rotary dim ", rd, " for head dim ", d);
  TORCH_CHECK(cos.numel() == t * width && sin.numel() == t * width, "rope: tables must be [T, 1, ", width, "]");
  const at::Tensor xc = x.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  auto out = at::empty_like(xc);
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  const auto* cp = reinterpret_cast<const uint16_t*>(cc.data_ptr<at::BFloat16>());
  const auto* sp = reinterpret_cast<const uint16_t*>(sc.data_ptr<at::BFloat16>());
  auto* yp = out.data_ptr<at::BFloat16>();
#if EDGEINFER_X86
  const bool vectors = !interleaved && half % 16 == 0 && edgeinfer_cpu::isa_allows(Isa::kAvx512);
#else
  const bool vectors = false;
#endif
  at::parallel_for(0, t * h, std::max<int64_t>(1, 65536 / std::max<int64_t>(d, 1)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const uint16_t *row = xp + i * d, *c = cp + (i / h) * width, *s = sp + (i / h) * width;
      c10::BFloat16* y = yp + i * d;
#if EDGEINFER_X86
      if (vectors) {
        rotate_halves_avx512(row, c, s, half, y);
        for (int64_t j = rd; j < d; ++j) y[j] = c10::BFloat16(bf16_bits_to_float(row[j]));
        continue;
      }
#endif
      for (int64_t j = 0; j < half; ++j) {
        const int64_t a = interleaved ? 2 * j : j, b = interleaved ? 2 * j + 1 : j + half;
        const float x1 = bf16_bits_to_float(row[a]), x2 = bf16_bits_to_float(row[b]);
        const int64_t ta = interleaved ? j : a, tb = interleaved ? j : b;  // the tables' entries
        const float ca = bf16_bits_to_float(c[ta]), sa = bf16_bits_to_float(s[ta]);
        const float cb = bf16_bits_to_float(c[tb]), sb = bf16_bits_to_float(s[tb]);
        y[a] = c10::BFloat16(round_bf16(x1 * ca) - round_bf16(x2 * sa));  // halves: x1 cos + (-x2) sin
        y[b] = c10::BFloat16(round_bf16(x2 * cb) + round_bf16(x1 * sb));
      }
      for (int64_t j = rd; j < d; ++j) y[j] = c10::BFloat16(bf16_bits_to_float(row[j]));
    }
  });
  return out;
}

// ---- Gated activation -------------------------------------------------------------------------------

// act(gate) * up for gate_up [T, 2I] = [gate | up] in one call from Python: on AVX-512, gated_row_avx512
// (rows in parallel); elsewhere ATen's own vectorised activation, the same kernels and roundings as the
// three torch ops. `act`: 0 silu, 1 gelu (tanh).
at::Tensor gated_act(const at::Tensor& gate_up, int64_t act) {
  TORCH_CHECK(gate_up.scalar_type() == at::kBFloat16 && gate_up.dim() == 2 && gate_up.size(1) % 2 == 0,
              "gated_act: gate_up must be bf16 [T, 2 * intermediate]");
  TORCH_CHECK(act == 0 || act == 1, "gated_act: act must be 0 (silu) or 1 (gelu tanh)");
  const int64_t n = gate_up.size(1) / 2;
#if EDGEINFER_X86
  if (n % 16 == 0 && gate_up.is_contiguous() && isa_allows(Isa::kAvx512)) {
    auto out = at::empty({gate_up.size(0), n}, gate_up.options());
    const auto* x = reinterpret_cast<const uint16_t*>(gate_up.data_ptr<at::BFloat16>());
    auto* y = out.data_ptr<at::BFloat16>();
    at::parallel_for(0, gate_up.size(0), std::max<int64_t>(1, 16384 / n), [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r) {
        if (act == 1)
          gated_row_avx512<1>(x + r * 2 * n, x + r * 2 * n + n, n, y + r * n);
        else
          gated_row_avx512<0>(x + r * 2 * n, x + r * 2 * n + n, n, y + r * n);
      }
    });
    return out;
  }
#endif
  const at::Tensor gate = gate_up.narrow(1, 0, n), up = gate_up.narrow(1, n, n);
  at::Tensor out = act == 0 ? at::silu(gate) : at::gelu(gate, "tanh");
  return out.mul_(up);
}

}  // namespace edgeinfer_cpu

namespace {

// ---- Paged decode attention ------------------------------------------------------------------------
//
// A key's score is bf16(q . k x s) x scale and its value enters the sums as (p x s) v, where k and v are
// the key's rows of codes and s their scale (1 in a bf16 pool, where this is exactly what the eager path
// rounds). In an int8 / float8 pool that is the eager path's dequantize-then-attend with each value left
// unrounded where the eager path rounds it to bf16 first (half a bf16 step per value, well below the codes'
// own step): the codes are multiplied as they are, so a key's bytes are read once, at half bf16's size.

struct DecodeShape {
  int64_t hq, hkv, d, dv, block_size, ctx, first;  // `first`: the first key a sliding window lets in
};

// Where one side (K or V) of a step lies: token slot `flat`, KV head `h` -> a row of `dim` codes at
// `base + (flat * token + h * dim)` codes and, in a quantized pool, its scale at `scales[flat * heads + h]`.
// (MLA's values are the first `rank` entries of its latents: there `dim` < `token`.)
struct Side {
  const uint8_t* base;
  int64_t dim, token, heads;
  Fmt fmt;
  const float* scales;  // null in a bf16 pool

  const uint8_t* row(int64_t flat, int64_t h) const {
    return base + (flat * token + h * dim) * edgeinfer_cpu::kv::code_bytes(fmt);
  }
  float scale(int64_t flat, int64_t h) const { return scales[flat * heads + h]; }
};

// One (sequence, KV head)'s key and value rows and, in a quantized pool, their scales.
struct HeadRows {
  std::vector<const uint8_t*> k, v;
  std::vector<float> ks, vs;

  void resize(int64_t n, bool scaled) {
    k.resize(n);
    v.resize(n);
    ks.resize(scaled ? n : 0);
    vs.resize(scaled ? n : 0);
  }
  const float* k_scales(int64_t j0 = 0) const { return ks.empty() ? nullptr : ks.data() + j0; }
  const float* v_scales(int64_t j0 = 0) const { return vs.empty() ? nullptr : vs.data() + j0; }
};

// Rows [j0, j1) of KV head `h` of a sequence whose keys start at token `first` in the blocks `ids`.
void gather_rows(const Side& keys, const Side& vals, const int64_t* ids, int64_t block_size, int64_t first, int64_t h,
                 int64_t j0, int64_t j1, HeadRows& r) {
  for (int64_t j = j0; j < j1; ++j) {
    const int64_t t = first + j, flat = ids[t / block_size] * block_size + t % block_size;
    r.k[j] = keys.row(flat, h);
    r.v[j] = vals.row(flat, h);
    if (keys.scales) {
      r.ks[j] = keys.scale(flat, h);
      r.vs[j] = vals.scale(flat, h);
    }
  }
}

// Per-thread scratch of attend_head: the rows, attend_group's buffer, 16 keys' codes as bf16.
struct Scratch {
  HeadRows rows;
  std::vector<float> buf;
  std::vector<uint16_t> tile;
};

// Softmax of the fp32 scores in place, then rounded to bf16 as `probs.to(bf16)` does.
void softmax_bf16(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < n; ++j) mx = std::max(mx, s[j]);
  float sum = 0.f;
  for (int64_t j = 0; j < n; ++j) sum += (s[j] = std::exp(s[j] - mx));
  for (int64_t j = 0; j < n; ++j) s[j] = round_bf16(s[j] / sum);
}

// The query heads of one KV head against its keys [first, ctx): scores as a bf16 matmul rounds them,
// scaled in fp32, softmax, then the bf16 probabilities times V with fp32 sums. Each K and V row is
// widened to fp32 once for the whole group.
void attend_group(const float* q, int64_t group, const HeadRows& r, Fmt fmt, const DecodeShape& s, float scale,
                  c10::BFloat16* out, const Vec& v, std::vector<float>& buf) {
  const int64_t n = s.ctx - s.first;
  const int64_t row_len = std::max(s.d, s.dv);  // one widened K or V row
  const WidenCodes widen = v.codes[static_cast<int>(fmt)];
  const float *ks = r.k_scales(), *vs = r.v_scales();
  buf.resize(group * n + row_len + group * s.dv);
  float *scores = buf.data(), *row = scores + group * n, *acc = row + row_len;
  for (int64_t j = 0; j < n; ++j) {
    widen(r.k[j], row, s.d);
    const float key_scale = ks ? ks[j] : 1.f;
    for (int64_t g = 0; g < group; ++g)
      scores[g * n + j] = round_bf16(v.dot(q + g * s.d, row, s.d) * key_scale) * scale;
  }
  for (int64_t g = 0; g < group; ++g) softmax_bf16(scores + g * n, n);
  std::fill(acc, acc + group * s.dv, 0.f);
  for (int64_t j = 0; j < n; ++j) {
    widen(r.v[j], row, s.dv);
    const float value_scale = vs ? vs[j] : 1.f;
    for (int64_t g = 0; g < group; ++g) v.axpy(scores[g * n + j] * value_scale, row, acc + g * s.dv, s.dv);
  }
  for (int64_t i = 0; i < group * s.dv; ++i) out[i] = c10::BFloat16(acc[i]);
}

// p[g * stride + j] *= s[j] for the `group` heads and keys [0, n): each key's value scale folded into its
// probabilities, so the weighted sums multiply the codes as they are.
void scale_probs(float* p, int64_t stride, int64_t group, int64_t n, const float* s) {
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < n; ++j) p[g * stride + j] *= s[j];
}

#if EDGEINFER_X86
// ---- The same attention on AVX512-BF16 -----------------------------------------------------------------
//
// Scores 16 keys at a time: each key row against a query head is one `vdpbf16ps` chain over bf16 pairs
// (products exact, fp32 sums) and one transpose-add tree sums the 16 chains (isa.h's sum_lanes16);
// the softmax in vectors (exp by a degree-6 polynomial on the reduced argument, within ~1 ulp of
// std::exp); then V rows widened once per 64 outputs and multiplied into G query heads' sums in registers.
// That outruns the fp32 loops above at decode shapes (timings: docs/engine.md); the outputs
// equal theirs but for an occasional value one bf16 step apart. Quantized codes become bf16 (keys, exact)
// or fp32 (values) in registers (kv_codes.h).

// The 16 fp32 sums q . k_r for the bf16 rows ks[0..16) of `d` values (a multiple of 32).
EDGEINFER_TARGET_BF16 inline __m512 dot16(const uint16_t* q, const uint16_t* const* ks, int64_t d) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    const __m512bh qv = (__m512bh)_mm512_loadu_si512(q + c);
#pragma GCC unroll 16
    for (int r = 0; r < 16; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)_mm512_loadu_si512(ks[r] + c), qv);
  }
  return sum_lanes16(acc);
}

// A row of `d` one-byte codes (d a multiple of 32) -> their values as bf16 in `out`.
template <Fmt F>
EDGEINFER_TARGET_BF16 void codes_to_bf16(const uint8_t* row, int64_t d, uint16_t* out) {
  for (int64_t c = 0; c < d; c += 32) _mm512_storeu_si512(out + c, edgeinfer_cpu::kv::codes32_to_bf16<F>(row + c));
}

// scores[g * stride + j] = bf16(q_g . k_j x s_j) x scale for the `group` query heads q [group, d] and the
// keys [0, n) of `k_rows` (s_j from `k_scales`; none in a bf16 pool), 16 keys at a time (a partial last
// 16 computed on the last key again and not stored), each key read once for all the heads. A quantized
// key's codes are written to `tile` [16, d] as bf16 first.
template <Fmt F>
EDGEINFER_TARGET_BF16 void score_keys(const uint16_t* q, int64_t group, const uint8_t* const* k_rows,
                                      const float* k_scales, int64_t n, int64_t d, float scale, float* scores,
                                      int64_t stride, uint16_t* tile) {
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t left = std::min<int64_t>(16, n - j0);
    const auto store = static_cast<__mmask16>((1u << left) - 1);
    const uint16_t* ks[16];
    for (int r = 0; r < 16; ++r) {
      const int64_t i = std::min<int64_t>(r, left - 1);
      if constexpr (F == Fmt::kBf16) {
        ks[r] = reinterpret_cast<const uint16_t*>(k_rows[j0 + i]);
      } else {
        if (r < left) codes_to_bf16<F>(k_rows[j0 + r], d, tile + r * d);
        ks[r] = tile + i * d;
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      __m512 sv = dot16(q + g * d, ks, d);
      if constexpr (F != Fmt::kBf16) sv = _mm512_mul_ps(sv, _mm512_maskz_loadu_ps(store, k_scales + j0));
      sv = _mm512_mul_ps(round_bf16x16(sv), _mm512_set1_ps(scale));
      _mm512_mask_storeu_ps(scores + g * stride + j0, store, sv);
    }
  }
}

// softmax of scores [0, n) in place, the probabilities rounded to bf16 values.
EDGEINFER_TARGET_BF16 void softmax_bf16x16(float* s, int64_t n) {
  const auto mask = [n](int64_t j) { return static_cast<__mmask16>(n - j >= 16 ? 0xFFFF : (1u << (n - j)) - 1); };
  __m512 mx = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < n; j += 16) mx = _mm512_mask_max_ps(mx, mask(j), mx, _mm512_maskz_loadu_ps(mask(j), s + j));
  const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask(j), s + j), top));
    _mm512_mask_storeu_ps(s + j, mask(j), e);
    sum = _mm512_mask_add_ps(sum, mask(j), sum, e);
  }
  const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
  for (int64_t j = 0; j < n; j += 16)
    _mm512_mask_storeu_ps(s + j, mask(j), round_bf16x16(_mm512_div_ps(_mm512_maskz_loadu_ps(mask(j), s + j), total)));
}

// Values [i, i + 16) of a row (the lanes of `mask`) in fp32.
template <Fmt F>
EDGEINFER_TARGET_BF16 inline __m512 values16(const uint8_t* row, int64_t i, __mmask16 mask) {
  if constexpr (F == Fmt::kBf16)
    return edgeinfer_cpu::bf16x16_to_fp32(reinterpret_cast<const uint16_t*>(row) + i, mask);
  else
    return edgeinfer_cpu::kv::codes16_to_fp32<F>(row + i, mask);
}

// sums[g] = sum_j p[g * stride + j] v_j for G query heads, keys [0, n) of `v_rows`, and the outputs
// [c0, c0 + 64) (lanes past dv masked off), in fp32.
template <int G, Fmt F>
EDGEINFER_TARGET_BF16 void weigh_values(const float* p, int64_t stride, int64_t n, const uint8_t* const* v_rows,
                                        int64_t dv, int64_t c0, float* sums) {
  __mmask16 lanes[4];
  for (int c = 0; c < 4; ++c) {
    const int64_t left = std::clamp<int64_t>(dv - c0 - 16 * c, 0, 16);
    lanes[c] = static_cast<__mmask16>((1u << left) - 1);
  }
  __m512 acc[G][4];
  for (auto& head : acc)
    for (auto& a : head) a = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[4];
    for (int c = 0; c < 4; ++c) vv[c] = values16<F>(v_rows[j], c0 + 16 * c, lanes[c]);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(p[g * stride + j]);
      for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_fmadd_ps(pg, vv[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) _mm512_mask_storeu_ps(sums + g * dv + c0 + 16 * c, lanes[c], acc[g][c]);
}

// The weighted values of `group` query heads over keys [0, n) (probabilities p, `stride` apart per head)
// into fp32 sums [group, dv], G heads at a time.
template <Fmt F>
EDGEINFER_TARGET_BF16 void weigh_group(const float* p, int64_t stride, int64_t n, const uint8_t* const* v_rows,
                                       int64_t group, int64_t dv, float* sums) {
  const int heads = group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
  for (int64_t g = 0; g < group; g += heads)
    for (int64_t c0 = 0; c0 < dv; c0 += 64) {
      if (heads == 4)
        weigh_values<4, F>(p + g * stride, stride, n, v_rows, dv, c0, sums + g * dv);
      else if (heads == 2)
        weigh_values<2, F>(p + g * stride, stride, n, v_rows, dv, c0, sums + g * dv);
      else
        weigh_values<1, F>(p + g * stride, stride, n, v_rows, dv, c0, sums + g * dv);
    }
}

// attend_group on AVX512-BF16, for head dims that are multiples of 32 (keys) and 16 (values).
template <Fmt F>
EDGEINFER_TARGET_BF16 void attend_group_bf16(const uint16_t* q, int64_t group, const HeadRows& r, const DecodeShape& s,
                                             float scale, c10::BFloat16* out, Scratch& scratch) {
  const int64_t n = s.ctx - s.first;
  scratch.buf.resize(group * (n + s.dv));
  if (F != Fmt::kBf16) scratch.tile.resize(16 * s.d);
  float *scores = scratch.buf.data(), *sums = scores + group * n;
  score_keys<F>(q, group, r.k.data(), r.k_scales(), n, s.d, scale, scores, n, scratch.tile.data());
  for (int64_t g = 0; g < group; ++g) softmax_bf16x16(scores + g * n, n);
  if (F != Fmt::kBf16) scale_probs(scores, n, group, n, r.v_scales());
  weigh_group<F>(scores, n, n, r.v.data(), group, s.dv, sums);
  for (int64_t i = 0; i < group * s.dv; ++i) out[i] = c10::BFloat16(sums[i]);
}
#endif

// fn(std::integral_constant<Fmt, f>{}): a kernel templated on the pool's format, picked at run time.
template <typename Fn>
void with_format(Fmt f, Fn&& fn) {
  switch (f) {
    case Fmt::kBf16: return fn(std::integral_constant<Fmt, Fmt::kBf16>{});
    case Fmt::kInt8: return fn(std::integral_constant<Fmt, Fmt::kInt8>{});
    case Fmt::kE4m3: return fn(std::integral_constant<Fmt, Fmt::kE4m3>{});
    case Fmt::kE5m2: return fn(std::integral_constant<Fmt, Fmt::kE5m2>{});
  }
}

// A pool and its scales, checked: bf16 without scales, or int8 / float8 with fp32 scales
// [blocks, block_size, heads, 1] (quant/kv.py's layout).
Side side_of(const at::Tensor& pool, const std::optional<at::Tensor>& scales, const char* op) {
  TORCH_CHECK(pool.dim() == 4 && pool.is_contiguous(), op, ": pools must be contiguous [blocks, block_size, heads, dim]");
  const Fmt fmt = edgeinfer_cpu::kv::format_of(pool);
  const bool has_scales = scales.has_value() && scales->defined();
  const float* s = nullptr;
  if (fmt == Fmt::kBf16) {
    TORCH_CHECK(!has_scales, op, ": a bf16 pool has no scales");
  } else {
    TORCH_CHECK(has_scales && scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->dim() == 4 &&
                    scales->sizes().slice(0, 3) == pool.sizes().slice(0, 3) && scales->size(3) == 1,
                op, ": an int8 / float8 pool needs its contiguous fp32 scales [blocks, block_size, heads, 1]");
    s = scales->data_ptr<float>();
  }
  return {static_cast<const uint8_t*>(pool.data_ptr()), pool.size(3), pool.size(2) * pool.size(3), pool.size(2), fmt,
          s};
}

void check_pools(const at::Tensor& k_pool, const at::Tensor& v_pool, const char* op) {
  TORCH_CHECK(k_pool.sizes().slice(0, 3) == v_pool.sizes().slice(0, 3), op, ": K and V pools of different shapes");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), op, ": K and V pools of different dtypes");
}

// The query heads of KV head `h` of one sequence (`q16`: its query heads; `q`: the same in fp32, for the
// fp32 loops only) over its keys [s.first, s.ctx) in the blocks `ids` of the pools, where they lie -> `out` (its heads' outputs).
void attend_head(const float* q, const uint16_t* q16, const Side& keys, const Side& vals, const int64_t* ids,
                 const DecodeShape& s, int64_t h, float scale, c10::BFloat16* out, const Vec& vec, Scratch& scratch) {
  const int64_t group = s.hq / s.hkv, n = s.ctx - s.first;
  scratch.rows.resize(n, keys.scales != nullptr);
  gather_rows(keys, vals, ids, s.block_size, s.first, h, 0, n, scratch.rows);
#if EDGEINFER_X86
  if (vec.bf16_attention) {
    with_format(keys.fmt, [&](auto f) {
      attend_group_bf16<decltype(f)::value>(q16 + h * group * s.d, group, scratch.rows, s, scale,
                                            out + h * group * s.dv, scratch);
    });
    return;
  }
#endif
  attend_group(q + h * group * s.d, group, scratch.rows, keys.fmt, s, scale, out + h * group * s.dv, vec, scratch.buf);
}

// Each of `batch` sequences' `ctx[b]` tokens fits its row of `ids` [batch, width], and every block id it
// reads is a block of the pool.
void check_tables(const int64_t* ids, int64_t width, const int64_t* ctx, int64_t batch, int64_t block_size,
                  int64_t pool_blocks, const char* op) {
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(ctx[b] >= 1 && ctx[b] <= width * block_size, op, ": ", width, " blocks cannot hold ", ctx[b],
                " tokens");
    for (int64_t i = 0; i * block_size < ctx[b]; ++i)
      TORCH_CHECK(ids[b * width + i] >= 0 && ids[b * width + i] < pool_blocks, op, ": block id ",
                  ids[b * width + i], " out of range");
  }
}

#if EDGEINFER_X86
// A sequence attending more keys than this (per KV head) is attended a chunk of keys at a time: the
// scores and the weighted values of each chunk in parallel, the softmax over all of them, the chunks'
// sums added in order. One long sequence then keeps every thread busy instead of one. The chunks follow
// from its length alone, so its result does not depend on the batch it decodes in or the thread count.
constexpr int64_t kKeyChunk = 2048;

// One (sequence, KV head) of a step that has long sequences: its key and value rows, the scores of its
// query heads [group, n], and each chunk's weighted values [chunks, group, dv].
struct ChunkedHead {
  int64_t b, h, chunks;
  DecodeShape s;
  HeadRows rows;
  std::vector<float> scores, sums;
};

template <Fmt F>
void attend_chunked(const uint16_t* q16, const Side& keys, const Side& vals, const int64_t* ids, int64_t width,
                    std::vector<ChunkedHead>& heads, float scale, c10::BFloat16* out) {
  std::vector<std::pair<int64_t, int64_t>> work;  // (head, chunk)
  for (int64_t i = 0; i < static_cast<int64_t>(heads.size()); ++i)
    for (int64_t c = 0; c < heads[i].chunks; ++c) work.emplace_back(i, c);
  const auto n_of = [](const ChunkedHead& x) { return x.s.ctx - x.s.first; };
  const auto group_of = [](const ChunkedHead& x) { return x.s.hq / x.s.hkv; };
  const auto query = [&](const ChunkedHead& x) { return q16 + (x.b * x.s.hq + x.h * group_of(x)) * x.s.d; };
  const int64_t items = static_cast<int64_t>(work.size());
  at::parallel_for(0, items, 1, [&](int64_t w0, int64_t w1) {  // rows and scores, chunk by chunk
    std::vector<uint16_t> tile(F == Fmt::kBf16 ? 0 : 16 * keys.dim);
    for (int64_t w = w0; w < w1; ++w) {
      ChunkedHead& x = heads[work[w].first];
      const int64_t n = n_of(x), j0 = work[w].second * kKeyChunk, j1 = std::min(n, j0 + kKeyChunk);
      gather_rows(keys, vals, ids + x.b * width, x.s.block_size, x.s.first, x.h, j0, j1, x.rows);
      score_keys<F>(query(x), group_of(x), x.rows.k.data() + j0, x.rows.k_scales(j0), j1 - j0, x.s.d, scale,
                    x.scores.data() + j0, n, tile.data());
    }
  });
  at::parallel_for(0, static_cast<int64_t>(heads.size()), 1, [&](int64_t i0, int64_t i1) {  // softmax over all
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t n = n_of(heads[i]);
      for (int64_t g = 0; g < group_of(heads[i]); ++g) softmax_bf16x16(heads[i].scores.data() + g * n, n);
    }
  });
  at::parallel_for(0, items, 1, [&](int64_t w0, int64_t w1) {  // weighted values, chunk by chunk
    for (int64_t w = w0; w < w1; ++w) {
      ChunkedHead& x = heads[work[w].first];
      const int64_t n = n_of(x), c = work[w].second, j0 = c * kKeyChunk, j1 = std::min(n, j0 + kKeyChunk);
      if (F != Fmt::kBf16) scale_probs(x.scores.data() + j0, n, group_of(x), j1 - j0, x.rows.v_scales(j0));
      weigh_group<F>(x.scores.data() + j0, n, j1 - j0, x.rows.v.data() + j0, group_of(x), x.s.dv,
                     x.sums.data() + c * group_of(x) * x.s.dv);
    }
  });
  for (const ChunkedHead& x : heads) {  // the chunks' sums in order
    const int64_t size = group_of(x) * x.s.dv;
    c10::BFloat16* o = out + (x.b * x.s.hq + x.h * group_of(x)) * x.s.dv;
    for (int64_t i = 0; i < size; ++i) {
      float sum = 0.f;
      for (int64_t c = 0; c < x.chunks; ++c) sum += x.sums[c * size + i];
      o[i] = c10::BFloat16(sum);
    }
  }
}
#endif

// q [B, Hq, D], the new tokens' K/V already in the pools, attended over sequence b's `ctx[b]` tokens in
// row b of `ids` [B, width] (window > 0: only the last `window` keys), one task per (sequence, KV head),
// or a chunk of keys at a time where some sequence is long (attend_chunked).
at::Tensor attend_sequences(const at::Tensor& q, const Side& keys, const Side& vals, int64_t block_size,
                            const int64_t* ids, int64_t width, const int64_t* ctx, double scale, int64_t window) {
  const int64_t batch = q.size(0), hq = q.size(1), hkv = keys.heads, d = keys.dim, dv = vals.dim;
  Vec vec = pick();
  vec.bf16_attention = vec.bf16_attention && d % 32 == 0 && dv % 16 == 0;
  const at::Tensor qc = q.contiguous(), qf = vec.bf16_attention ? at::Tensor() : q.to(at::kFloat).contiguous();
  const auto* q16 = reinterpret_cast<const uint16_t*>(qc.data_ptr<at::BFloat16>());
  const float* q32 = qf.defined() ? qf.data_ptr<float>() : nullptr;
  auto out = at::empty({batch, hq, dv}, q.options());
  const auto shape = [&](int64_t b) {
    return DecodeShape{hq, hkv, d, dv, block_size, ctx[b], window > 0 ? std::max<int64_t>(0, ctx[b] - window) : 0};
  };
#if EDGEINFER_X86
  bool some_long = false;
  for (int64_t b = 0; b < batch; ++b) some_long |= shape(b).ctx - shape(b).first > kKeyChunk;
  if (vec.bf16_attention && some_long) {
    std::vector<ChunkedHead> heads;
    for (int64_t b = 0; b < batch; ++b)
      for (int64_t h = 0; h < hkv; ++h) {
        const DecodeShape s = shape(b);
        const int64_t n = s.ctx - s.first, chunks = (n + kKeyChunk - 1) / kKeyChunk, group = hq / hkv;
        heads.push_back({b, h, chunks, s, HeadRows{}, std::vector<float>(group * n), std::vector<float>(chunks * group * dv)});
        heads.back().rows.resize(n, keys.scales != nullptr);
      }
    with_format(keys.fmt, [&](auto f) {
      attend_chunked<decltype(f)::value>(q16, keys, vals, ids, width, heads, static_cast<float>(scale),
                                         out.data_ptr<at::BFloat16>());
    });
    return out;
  }
#endif
  // tasks split across threads only when the contexts are long enough to repay a parallel region
  const int64_t longest = *std::max_element(ctx, ctx + batch);
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(longest * (hq / hkv), 1));
  at::parallel_for(0, batch * hkv, grain, [&](int64_t t0, int64_t t1) {
    Scratch scratch;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / hkv, h = t % hkv;
      const DecodeShape s = shape(b);
      attend_head(q32 ? q32 + b * hq * s.d : nullptr, q16 + b * hq * s.d, keys, vals, ids + b * width, s, h,
                  static_cast<float>(scale), out.data_ptr<at::BFloat16>() + b * hq * dv, vec, scratch);
    }
  });
  return out;
}

// The step's block tables and context lengths, checked against the pool.
struct Tables {
  at::Tensor tables, lens;
  const int64_t *ids, *ctx;
  int64_t width;
};

Tables checked_tables(const at::Tensor& block_tables, const at::Tensor& ctx_lens, int64_t batch,
                      const at::Tensor& pool, const char* op) {
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.size(0) == batch,
              op, ": block_tables must be int64 [B, n]");
  TORCH_CHECK(ctx_lens.scalar_type() == at::kLong && ctx_lens.dim() == 1 && ctx_lens.size(0) == batch, op,
              ": ctx_lens must be int64 [B]");
  Tables t{block_tables.contiguous(), ctx_lens.contiguous(), nullptr, nullptr, 0};
  t.ids = t.tables.data_ptr<int64_t>();
  t.ctx = t.lens.data_ptr<int64_t>();
  t.width = t.tables.size(1);
  check_tables(t.ids, t.width, t.ctx, batch, pool.size(1), pool.size(0), op);
  return t;
}

}  // namespace

namespace edgeinfer_cpu {

// Writes k, v [1, Hkv, D] at flat `slot` of the pools (quantized as quant/kv.py quantizes them where the
// pools hold codes: kv_write.cpp), then returns the attention of q [1, Hq, D] over the sequence's `ctx`
// tokens in `blocks` [n] (window > 0: only the last `window` keys).
at::Tensor paged_decode_one(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& k_pool,
                            at::Tensor& v_pool, int64_t slot, const at::Tensor& blocks, int64_t ctx, double scale,
                            int64_t window, const std::optional<at::Tensor>& k_scales,
                            const std::optional<at::Tensor>& v_scales) {
  const char* op = "paged_decode_one";
  const Side keys = side_of(k_pool, k_scales, op), vals = side_of(v_pool, v_scales, op);
  check_pools(k_pool, v_pool, op);
  for (auto [x, side] : {std::pair{&k, &keys}, {&v, &vals}})
    TORCH_CHECK(x->scalar_type() == at::kBFloat16 && x->numel() == side->heads * side->dim, op,
                ": k and v must be one token's bf16 [1, heads, dim] of the pools' shape");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.size(0) == 1 && q.size(2) == keys.dim,
              "paged_decode_one: q must be bf16 [1, heads, head_dim]");
  TORCH_CHECK(blocks.scalar_type() == at::kLong && blocks.dim() == 1, "paged_decode_one: blocks must be int64 [n]");
  const int64_t block_size = k_pool.size(1);
  TORCH_CHECK(q.size(1) % keys.heads == 0, "paged_decode_one: query heads must be a multiple of KV heads");
  const at::Tensor table = blocks.contiguous();
  check_tables(table.data_ptr<int64_t>(), table.size(0), &ctx, 1, block_size, k_pool.size(0), op);
  TORCH_CHECK(slot >= 0 && slot < k_pool.size(0) * block_size, "paged_decode_one: slot out of range");
  write_kv(k_pool, k_scales.value_or(at::Tensor()), &slot, 1, k);
  write_kv(v_pool, v_scales.value_or(at::Tensor()), &slot, 1, v);
  return attend_sequences(q, keys, vals, block_size, table.data_ptr<int64_t>(), table.size(0), &ctx, scale, window);
}

// One query token per sequence, q [B, Hq, D], its K/V already written, attended over each sequence's
// `ctx_lens[b]` tokens in row b of `block_tables` [B, n] where they lie (window > 0: only the last
// `window` keys): what the torch path computes from a gather of every sequence's blocks, one task per
// (sequence, KV head) instead. Pools of int8 / float8 codes come with their scales.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale, int64_t window,
                        const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales) {
  const Side keys = side_of(k_pool, k_scales, "paged_decode"), vals = side_of(v_pool, v_scales, "paged_decode");
  check_pools(k_pool, v_pool, "paged_decode");
  const int64_t batch = q.size(0);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.size(2) == keys.dim &&
                  q.size(1) % keys.heads == 0,
              "paged_decode: q must be bf16 [B, heads, head_dim], heads a multiple of the pools' KV heads");
  if (batch == 0) return at::empty({0, q.size(1), vals.dim}, q.options());
  const Tables t = checked_tables(block_tables, ctx_lens, batch, k_pool, "paged_decode");
  return attend_sequences(q, keys, vals, k_pool.size(1), t.ids, t.width, t.ctx, scale, window);
}

// MLA's absorbed decode attention: q [B, H, rank + rope] against each sequence's latents [c ; k_pe] in the
// pool [blocks, block_size, 1, rank + rope] (one key shared by every head), the values being the latents'
// first `rank` entries -> [B, H, rank].
at::Tensor paged_decode_latent(const at::Tensor& q, const at::Tensor& latent_pool, const at::Tensor& block_tables,
                               const at::Tensor& ctx_lens, int64_t rank, double scale) {
  TORCH_CHECK(latent_pool.dim() == 4 && latent_pool.size(2) == 1 && latent_pool.scalar_type() == at::kBFloat16 &&
                  latent_pool.is_contiguous(),
              "paged_decode_latent: the pool must be contiguous bf16 [blocks, block_size, 1, latent]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && q.dim() == 3 && q.size(2) == latent_pool.size(3),
              "paged_decode_latent: q must be bf16 [B, heads, latent]");
  TORCH_CHECK(rank > 0 && rank < latent_pool.size(3), "paged_decode_latent: rank out of range");
  const int64_t batch = q.size(0);
  if (batch == 0) return at::empty({0, q.size(1), rank}, q.options());
  const Tables t = checked_tables(block_tables, ctx_lens, batch, latent_pool, "paged_decode_latent");
  const auto* base = static_cast<const uint8_t*>(latent_pool.data_ptr());
  const int64_t latent = latent_pool.size(3);
  const Side keys{base, latent, latent, 1, Fmt::kBf16, nullptr}, vals{base, rank, latent, 1, Fmt::kBf16, nullptr};
  return attend_sequences(q, keys, vals, latent_pool.size(1), t.ids, t.width, t.ctx, scale, 0);
}

}  // namespace edgeinfer_cpu

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool round_first) -> Tensor");
  m.def("rope(Tensor x, Tensor cos, Tensor sin, int rotary_dim, bool interleaved) -> Tensor");
  m.def("gated_act(Tensor gate_up, int act) -> Tensor");
  m.def(
      "paged_decode_one(Tensor q, Tensor k, Tensor v, Tensor(a!) k_pool, Tensor(b!) v_pool, int slot, "
      "Tensor blocks, int ctx, float scale, int window, Tensor(c!)? k_scales=None, Tensor(d!)? v_scales=None) "
      "-> Tensor");
  m.def(
      "paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_tables, Tensor ctx_lens, float scale, "
      "int window, Tensor? k_scales=None, Tensor? v_scales=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) {
  m.impl("rms_norm", edgeinfer_cpu::rms_norm);
  m.impl("rope", edgeinfer_cpu::rope);
  m.impl("gated_act", edgeinfer_cpu::gated_act);
  m.impl("paged_decode_one", edgeinfer_cpu::paged_decode_one);
  m.impl("paged_decode", edgeinfer_cpu::paged_decode);
}
