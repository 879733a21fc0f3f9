// bf16 products y[M, N] = x[M, K] @ W[N, K]^T with W held in the lossless resident form of kernels/lossless.py
// (docs/lossless-weights.md): per weight one byte of sign and mantissa and a 3-bit exponent code, stored as
// three bit-planes per block of 32 inputs; codes 0-6 index the matrix's table of its seven commonest
// exponents, code 7 takes the next entry of the escape list (the whole exponent field, 16 bits, so that it
// merges into the decoded vector as it is). Escapes run row after row; `offsets` gives where each group of
// kGroup rows starts in the list, so groups decode independently.
//
// A block of 32 decodes with a few AVX-512 instructions: the planes become a code vector (three masked
// adds), the table is a `vpermw`, the escaped lanes take their fields through one merging `vpexpandw` (no
// branch: about half the blocks of trained weights hold an escape, a branch on them would mispredict), and
// the sign byte, sign-extended, merges with the exponent in one `vpternlogd`. The decoded block is exactly
// the bf16 block, and the sums are those of bf16_tiles.cpp in the same order, so the products equal
// `bf16_gemv`'s bit for bit: one activation row runs the chains of `tile_in_order` on the blocks as they
// are decoded (one sequential stream per row, fewer bytes than bf16); several rows decode a block of weight
// rows into a thread's buffer and run bf16_tiles.cpp's tiles on it (`bf16_tiles_rows`).
//
// Without AVX512-BF16 and VBMI2 (or under a lower EDGEINFER_CPU_ISA cap) the weight is decoded whole and
// multiplied by `bf16_gemv_out`: the same sums as the bf16 model's on that CPU, without the savings.

#include "isa.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kGroup = 16;   // rows per escape offset (kernels/lossless.py GROUP)
constexpr int64_t kBlock = 80;   // weight rows a task decodes for several activation rows (bf16_tiles kBlock)
constexpr int kEscape = 7;       // the code of an escaped exponent
constexpr int64_t kGrainBytes = 64 * 1024;

#define EDGEINFER_TARGET_LOSSLESS \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi2,popcnt")))

// The form's tensors as raw pointers: `k` inputs a row, `kp` the same rounded up to whole blocks.
struct Form {
  const uint8_t* sign_mantissa;  // [n, kp]
  const uint32_t* planes;        // [n, kp / 32, 3]
  const uint16_t* escapes;       // the escaped exponents as bf16 fields (e << 7), then 32 of padding
  const int64_t* offsets;        // [ceil(n / kGroup) + 1]: the first escape of each group of rows
  const int16_t* table;          // [8]: the exponent of codes 0-6
  int64_t n, k, kp;
};

void check(const at::Tensor& x, const at::Tensor& sm, const at::Tensor& planes, const at::Tensor& escapes,
           const at::Tensor& offsets, const at::Tensor& table) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "lossless_gemv: x must be bf16 [M, K]");
  TORCH_CHECK(sm.dim() == 2 && sm.scalar_type() == at::kByte && sm.is_contiguous() && sm.size(1) % 32 == 0 &&
                  sm.size(1) >= x.size(1) && sm.size(1) < x.size(1) + 32,
              "lossless_gemv: sign_mantissa must be contiguous uint8 [N, K rounded up to 32]");
  TORCH_CHECK(planes.scalar_type() == at::kInt && planes.is_contiguous() && planes.numel() == sm.numel() / 32 * 3,
              "lossless_gemv: planes must be contiguous int32 [N, K / 32, 3]");
  TORCH_CHECK(escapes.scalar_type() == at::kShort && escapes.dim() == 1 && escapes.is_contiguous(),
              "lossless_gemv: escapes must be contiguous int16");
  const int64_t groups = (sm.size(0) + kGroup - 1) / kGroup;
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.size(0) == groups + 1,
              "lossless_gemv: offsets must be int64 [ceil(N / 16) + 1]");
  TORCH_CHECK(table.scalar_type() == at::kShort && table.numel() == 8 && table.is_contiguous(),
              "lossless_gemv: table must be int16 [8]");
  TORCH_CHECK(escapes.size(0) >= offsets[groups].item<int64_t>() + 32, "lossless_gemv: escapes lack padding");
}

Form form_of(int64_t k, const at::Tensor& sm, const at::Tensor& planes, const at::Tensor& escapes,
             const at::Tensor& offsets, const at::Tensor& table) {
  return {sm.data_ptr<uint8_t>(),
          reinterpret_cast<const uint32_t*>(planes.data_ptr<int32_t>()),
          reinterpret_cast<const uint16_t*>(escapes.data_ptr<int16_t>()),
          offsets.data_ptr<int64_t>(),
          table.data_ptr<int16_t>(),
          sm.size(0),
          k,
          sm.size(1)};
}

// The escaped lanes of a block: code 7, all three planes set.
inline uint32_t escaped(const uint32_t* p) { return p[0] & p[1] & p[2]; }

// The first escape of row `r`: its group's offset plus the escapes of the group's rows before it.
int64_t row_escape(const Form& f, int64_t r) {
  int64_t at = f.offsets[r / kGroup];
  const int64_t blocks = f.kp / 32;
  for (int64_t q = r / kGroup * kGroup; q < r; ++q)
    for (int64_t b = 0; b < blocks; ++b) at += __builtin_popcount(escaped(f.planes + (q * blocks + b) * 3));
  return at;
}

// Row `r` decoded into `out` (k values), plain loops; returns the escape index after it.
int64_t decode_row_scalar(const Form& f, int64_t r, int64_t esc, uint16_t* out) {
  const uint8_t* sm = f.sign_mantissa + r * f.kp;
  const uint32_t* p = f.planes + r * (f.kp / 32) * 3;
  for (int64_t i = 0; i < f.kp; ++i) {
    const uint32_t* pb = p + i / 32 * 3;
    const int lane = i % 32;
    const int code = ((pb[0] >> lane) & 1) | (((pb[1] >> lane) & 1) << 1) | (((pb[2] >> lane) & 1) << 2);
    const uint16_t e = code == kEscape ? f.escapes[esc++] : static_cast<uint16_t>((f.table[code] & 0xFF) << 7);
    if (i < f.k) out[i] = static_cast<uint16_t>(((sm[i] & 0x80) << 8) | e | (sm[i] & 0x7F));
  }
  return esc;
}

#if EDGEINFER_X86
// The decoder's constants: the table as bf16 exponent fields (e << 7) in the first 8 lanes.
struct Consts {
  __m512i table, sign_mantissa, one, two, four;
};

EDGEINFER_TARGET_LOSSLESS inline Consts consts_of(const Form& f) {
  alignas(64) int16_t lanes[32] = {};
  for (int i = 0; i < 8; ++i) lanes[i] = static_cast<int16_t>((f.table[i] & 0xFF) << 7);
  return {_mm512_load_si512(lanes), _mm512_set1_epi16(static_cast<int16_t>(0x807F)), _mm512_set1_epi16(1),
          _mm512_set1_epi16(2), _mm512_set1_epi16(4)};
}

// One block of 32 weights as bf16 bits (lane i = input i); advances `esc` past its escapes.
EDGEINFER_TARGET_LOSSLESS inline __m512i decode32(const Consts& c, const uint8_t* sm, const uint32_t* p,
                                                  const uint16_t*& esc) {
  // the escaped lanes' mask and count in general registers: fewer mask-register operations
  const uint32_t x = escaped(p);
  __m512i code = _mm512_maskz_mov_epi16(_cvtu32_mask32(p[0]), c.one);
  code = _mm512_mask_add_epi16(code, _cvtu32_mask32(p[1]), code, c.two);
  code = _mm512_mask_add_epi16(code, _cvtu32_mask32(p[2]), code, c.four);
  __m512i e = _mm512_permutexvar_epi16(code, c.table);
  e = _mm512_mask_expand_epi16(e, _cvtu32_mask32(x), _mm512_loadu_si512(esc));
  esc += _mm_popcnt_u32(x);
  const __m512i s = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sm)));
  return _mm512_ternarylogic_epi32(s, c.sign_mantissa, e, 0xEA);  // (s & 0x807F) | e
}

// Row `r` decoded into `out` (k values); returns the escape pointer after it.
EDGEINFER_TARGET_LOSSLESS const uint16_t* decode_row(const Form& f, const Consts& c, int64_t r, const uint16_t* esc,
                                                     uint16_t* out) {
  const uint8_t* sm = f.sign_mantissa + r * f.kp;
  const uint32_t* p = f.planes + r * (f.kp / 32) * 3;
  const int64_t body = f.k & ~int64_t{31};
  int64_t i = 0;
  for (; i < body; i += 32, p += 3) _mm512_storeu_si512(out + i, decode32(c, sm + i, p, esc));
  if (i < f.kp) {
    const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (f.k - body)) - 1);
    _mm512_mask_storeu_epi16(out + i, tail, decode32(c, sm + i, p, esc));
  }
  return esc;
}

// One activation row against weight rows [n0, n0 + 16) (fewer at the end), each decoded as it streams by:
// bf16_tiles.cpp's `tile_in_order`, chain for chain.
EDGEINFER_TARGET_LOSSLESS void rows_in_order(const Form& f, const Consts& c, const uint16_t* x, int64_t n0,
                                             float* out_f32, at::BFloat16* out_bf16) {
  const int64_t nb = std::min<int64_t>(kGroup, f.n - n0), body = f.k & ~int64_t{31};
  const __mmask32 tail = static_cast<__mmask32>((uint64_t{1} << (f.k - body)) - 1);
  const uint16_t* esc = f.escapes + f.offsets[n0 / kGroup];
  __m512 acc[16];
#pragma GCC unroll 16
  for (auto& a : acc) a = _mm512_setzero_ps();
  for (int64_t n = 0; n < nb; ++n) {
    const uint8_t* sm = f.sign_mantissa + (n0 + n) * f.kp;
    const uint32_t* p = f.planes + (n0 + n) * (f.kp / 32) * 3;
    __m512 a = _mm512_setzero_ps();
    for (int64_t i = 0; i < body; i += 32, p += 3)
      a = _mm512_dpbf16_ps(a, (__m512bh)decode32(c, sm + i, p, esc), (__m512bh)_mm512_loadu_si512(x + i));
    if (tail)
      a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_mov_epi16(tail, decode32(c, sm + body, p, esc)),
                           (__m512bh)_mm512_maskz_loadu_epi16(tail, x + body));
    acc[n] = a;
  }
  const __m512 sums = edgeinfer_cpu::sum_lanes16(acc);
  const __mmask16 lanes = static_cast<__mmask16>((1u << nb) - 1);
  if (out_f32)
    _mm512_mask_storeu_ps(out_f32 + n0, lanes, sums);
  else
    _mm256_mask_storeu_epi16(out_bf16 + n0, lanes, edgeinfer_cpu::bf16_bits(sums));
}

bool fast_variant() {
  static const bool vbmi2 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("popcnt");
  }();
  return vbmi2 && edgeinfer_cpu::isa_allows(edgeinfer_cpu::Isa::kAvx512Bf16);
}
#else
bool fast_variant() { return false; }
#endif

#if EDGEINFER_X86
EDGEINFER_TARGET_LOSSLESS void decode_rows_fast(const Form& f, int64_t r0, int64_t r1, uint16_t* out) {
  const Consts c = consts_of(f);
  const uint16_t* esc = f.escapes + f.offsets[r0 / kGroup];
  for (int64_t r = r0; r < r1; ++r) esc = decode_row(f, c, r, esc, out + (r - r0) * f.k);
}
#endif

// Rows [r0, r1) (r0 a group's first row) decoded into `out` [r1 - r0, k].
void decode_rows(const Form& f, int64_t r0, int64_t r1, uint16_t* out) {
#if EDGEINFER_X86
  if (fast_variant()) return decode_rows_fast(f, r0, r1, out);
#endif
  int64_t esc = f.offsets[r0 / kGroup];
  for (int64_t r = r0; r < r1; ++r) esc = decode_row_scalar(f, r, esc, out + (r - r0) * f.k);
}

at::Tensor decode_all(const Form& f) {
  at::Tensor w = at::empty({f.n, f.k}, at::kBFloat16);
  auto* out = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  const int64_t groups = (f.n + kGroup - 1) / kGroup;
  at::parallel_for(0, groups, std::max<int64_t>(1, kGrainBytes / (kGroup * f.k * 2)), [&](int64_t g0, int64_t g1) {
    decode_rows(f, g0 * kGroup, std::min(f.n, g1 * kGroup), out + g0 * kGroup * f.k);
  });
  return w;
}

#if EDGEINFER_X86
EDGEINFER_TARGET_LOSSLESS void gemv_one_row(const Form& f, const at::Tensor& x, at::Tensor& out) {
  const Consts c = consts_of(f);
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* out_f32 = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  at::BFloat16* out_bf16 = out_f32 ? nullptr : out.data_ptr<at::BFloat16>();
  const int64_t groups = (f.n + kGroup - 1) / kGroup;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kGroup * f.kp * 3 / 2));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) rows_in_order(f, c, xs, g * kGroup, out_f32, out_bf16);
  });
}

// Several activation rows: each task decodes its blocks of kBlock weight rows into a buffer and runs the
// bf16 tiles on them.
void gemv_rows(const Form& f, const at::Tensor& x, at::Tensor& out) {
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* out_f32 = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  at::BFloat16* out_bf16 = out_f32 ? nullptr : out.data_ptr<at::BFloat16>();
  const int64_t blocks = (f.n + kBlock - 1) / kBlock, m = x.size(0);
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kBlock * f.k * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    std::vector<uint16_t> buffer(kBlock * f.k);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kBlock, rows = std::min(kBlock, f.n - n0);
      decode_rows(f, n0, n0 + rows, buffer.data());
      edgeinfer_cpu::bf16_tiles_rows(xs, m, buffer.data(), rows, f.k, out_f32 ? out_f32 + n0 : nullptr,
                                     out_bf16 ? out_bf16 + n0 : nullptr, f.n);
    }
  });
}
#endif

}  // namespace

namespace edgeinfer_cpu {

void lossless_gemv_out(const at::Tensor& x, const at::Tensor& sm, const at::Tensor& planes,
                       const at::Tensor& escapes, const at::Tensor& offsets, const at::Tensor& table,
                       at::Tensor& out) {
  check(x, sm, planes, escapes, offsets, table);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == sm.size(0) && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "lossless_gemv: out must be contiguous fp32 or bf16 [M, N]");
  const Form f = form_of(x.size(1), sm, planes, escapes, offsets, table);
  if (x.size(0) == 0 || f.n == 0) return;
  const at::Tensor xc = x.contiguous();
#if EDGEINFER_X86
  if (fast_variant()) return xc.size(0) == 1 ? gemv_one_row(f, xc, out) : gemv_rows(f, xc, out);
#endif
  bf16_gemv_out(xc, decode_all(f), out);
}

at::Tensor lossless_gemv(const at::Tensor& x, const at::Tensor& sm, const at::Tensor& planes,
                         const at::Tensor& escapes, const at::Tensor& offsets, const at::Tensor& table) {
  at::Tensor out = at::empty({x.size(0), sm.size(0)}, x.options());
  lossless_gemv_out(x, sm, planes, escapes, offsets, table, out);
  return out;
}

// The bf16 weight [N, K] of a form whose rows hold `k` inputs.
at::Tensor lossless_decode(int64_t k, const at::Tensor& sm, const at::Tensor& planes, const at::Tensor& escapes,
                           const at::Tensor& offsets, const at::Tensor& table) {
  check(at::empty({0, k}, at::kBFloat16), sm, planes, escapes, offsets, table);
  return decode_all(form_of(k, sm, planes, escapes, offsets, table));
}

// Rows `ids` (any shape, int64) of the bf16 weight -> [*ids.shape, k]: an embedding lookup.
at::Tensor lossless_rows(const at::Tensor& ids, int64_t k, const at::Tensor& sm, const at::Tensor& planes,
                         const at::Tensor& escapes, const at::Tensor& offsets, const at::Tensor& table) {
  check(at::empty({0, k}, at::kBFloat16), sm, planes, escapes, offsets, table);
  const Form f = form_of(k, sm, planes, escapes, offsets, table);
  const at::Tensor flat = ids.reshape(-1).to(at::kLong).contiguous();
  const int64_t* rows = flat.data_ptr<int64_t>();
  for (int64_t i = 0; i < flat.numel(); ++i)
    TORCH_CHECK(rows[i] >= 0 && rows[i] < f.n, "lossless_rows: row ", rows[i], " out of range [0, ", f.n, ")");
  std::vector<int64_t> shape(ids.sizes().begin(), ids.sizes().end());
  shape.push_back(k);
  at::Tensor out = at::empty(shape, at::kBFloat16);
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, flat.numel(), 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) decode_row_scalar(f, rows[i], row_escape(f, rows[i]), o + i * k);
  });
  return out;
}

}  // namespace edgeinfer_cpu

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def(
      "lossless_gemv(Tensor x, Tensor sign_mantissa, Tensor planes, Tensor escapes, Tensor offsets, Tensor table) "
      "-> Tensor");
  m.def(
      "lossless_gemv_out(Tensor x, Tensor sign_mantissa, Tensor planes, Tensor escapes, Tensor offsets, "
      "Tensor table, Tensor(a!) out) -> ()");
  m.def(
      "lossless_decode(int k, Tensor sign_mantissa, Tensor planes, Tensor escapes, Tensor offsets, Tensor table) "
      "-> Tensor");
  m.def(
      "lossless_rows(Tensor ids, int k, Tensor sign_mantissa, Tensor planes, Tensor escapes, Tensor offsets, "
      "Tensor table) -> Tensor");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) {
  m.impl("lossless_gemv", edgeinfer_cpu::lossless_gemv);
  m.impl("lossless_gemv_out", edgeinfer_cpu::lossless_gemv_out);
  m.impl("lossless_decode", edgeinfer_cpu::lossless_decode);
  m.impl("lossless_rows", edgeinfer_cpu::lossless_rows);
}
