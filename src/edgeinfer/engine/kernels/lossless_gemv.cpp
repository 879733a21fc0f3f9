// bf16 products y[M, N] = x[M, K] @ W[N, K]^T with W held in the lossless resident form of kernels/lossless.py
// (docs/lossless-weights.md): per weight its low byte (the exponent's last bit and the mantissa) raw and a
// 3-bit code for its high byte (the sign and the exponent's top seven bits), stored as three bit-planes per
// block of 64 inputs; codes 0-6 index the matrix's table of its seven commonest high bytes, code 7 takes the
// next entry of the escape list. A block's bytes are stored in `LANE_ORDER` (lossless.py). Escapes run row
// after row; `offsets` gives where each group of kGroup rows starts in the list, so groups decode
// independently.
//
// A block of 64 decodes with a few AVX-512 byte instructions: the planes become a code vector (a byte
// shuffle and a GF(2) affine product that transposes their bits), the table is one `vpermb`, the escaped lanes take their bytes through one merging `vpexpandb` (no
// branch: most blocks of trained weights hold an escape, a branch on them would mispredict), and
// `vpunpcklbw` / `vpunpckhbw` interleave low and high bytes into inputs 0-31 and 32-63 as bf16. The decoded
// block is exactly the bf16 block, and the sums are those of bf16_tiles.h in the same order, so the
// products equal `bf16_gemv`'s bit for bit: one activation row runs the chains of `tile_in_order` on the
// blocks as they are decoded (one sequential stream per row, fewer bytes than bf16); several rows run the
// tiles of bf16_tiles.h on a block of weight rows decoded into a thread's buffer, the tiles decoding the
// next block as they go (`DecodeSide`).
//
// Without AVX512-BF16, VBMI/VBMI2 and GFNI (or under a lower EDGEINFER_CPU_ISA cap) the weight is decoded whole
// and multiplied by `bf16_gemv_out`: the same sums as the bf16 model's on that CPU, without the savings.

#include "isa.h"

#define EDGEINFER_TARGET_LOSSLESS \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,avx512vbmi,avx512vbmi2,gfni,popcnt")))
#define EDGEINFER_TILES_TARGET EDGEINFER_TARGET_LOSSLESS  // the decoding side job inlines into the tiles

#include "bf16_tiles.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

namespace {

constexpr int64_t kGroup = 16;   // rows per escape offset (kernels/lossless.py GROUP)
constexpr int64_t kBlock = 80;   // weight rows a task decodes for several activation rows (bf16_tiles kBlock)
constexpr int64_t kFirst = 16;   // the rows of a task's first block (a multiple of kGroup)
constexpr int64_t kInputs = 64;  // inputs per block of codes (kernels/lossless.py BLOCK)
constexpr int kEscape = 7;       // the code of an escaped high byte
constexpr int64_t kGrainBytes = 64 * 1024;
constexpr int64_t kBufferBytes = 128 * 1024;  // a task's block of decoded rows at most (beyond kFirst)
constexpr int64_t kAhead = 32;                // blocks of 64 ahead of its decoding that DecodeSide fetches
constexpr int64_t kRideL1Bytes = 24 * 1024;   // the tiles' L1 use up to which DecodeSide rides along

// The form's tensors as raw pointers: `k` inputs a row, `kp` the same rounded up to whole blocks.
struct Form {
  const uint8_t* low_bytes;  // [n, kp], each block in LANE_ORDER
  const uint64_t* planes;    // [n, kp / 64, 3]
  const uint8_t* escapes;    // the escaped high bytes, then 64 of padding
  const int64_t* offsets;    // [ceil(n / kGroup) + 1]: the first escape of each group of rows
  const uint8_t* table;      // [8]: the high byte of codes 0-6
  int64_t n, k, kp;
};

void check(const at::Tensor& x, const at::Tensor& low, const at::Tensor& planes, const at::Tensor& escapes,
           const at::Tensor& offsets, const at::Tensor& table) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "lossless_gemv: x must be bf16 [M, K]");
  TORCH_CHECK(low.dim() == 2 && low.scalar_type() == at::kByte && low.is_contiguous() &&
                  low.size(1) % kInputs == 0 && low.size(1) >= x.size(1) && low.size(1) < x.size(1) + kInputs,
              "lossless_gemv: low_bytes must be contiguous uint8 [N, K rounded up to 64]");
  TORCH_CHECK(planes.scalar_type() == at::kLong && planes.is_contiguous() &&
                  planes.numel() == low.numel() / kInputs * 3,
              "lossless_gemv: planes must be contiguous int64 [N, K / 64, 3]");
  TORCH_CHECK(escapes.scalar_type() == at::kByte && escapes.dim() == 1 && escapes.is_contiguous(),
              "lossless_gemv: escapes must be contiguous uint8");
  const int64_t groups = (low.size(0) + kGroup - 1) / kGroup;
  TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && offsets.is_contiguous() &&
                  offsets.size(0) == groups + 1,
              "lossless_gemv: offsets must be contiguous int64 [ceil(N / 16) + 1]");
  TORCH_CHECK(table.scalar_type() == at::kByte && table.numel() == 8 && table.is_contiguous(),
              "lossless_gemv: table must be uint8 [8]");
  // the list's end read in place (an indexing op and `item` cost as much as a small product)
  TORCH_CHECK(escapes.size(0) >= offsets.data_ptr<int64_t>()[groups] + kInputs,
              "lossless_gemv: escapes lack padding");
}

Form form_of(int64_t k, const at::Tensor& low, const at::Tensor& planes, const at::Tensor& escapes,
             const at::Tensor& offsets, const at::Tensor& table) {
  return {low.data_ptr<uint8_t>(),
          reinterpret_cast<const uint64_t*>(planes.data_ptr<int64_t>()),
          escapes.data_ptr<uint8_t>(),
          offsets.data_ptr<int64_t>(),
          table.data_ptr<uint8_t>(),
          low.size(0),
          k,
          low.size(1)};
}

// The escaped lanes of a block: code 7, all three planes set.
inline uint64_t escaped(const uint64_t* p) { return p[0] & p[1] & p[2]; }

// The input a block's stored byte `at` holds (kernels/lossless.py LANE_ORDER).
inline int64_t input_of(int at) {
  const int lane = at / 16, j = at % 16;
  return j < 8 ? lane * 8 + j : 32 + lane * 8 + j - 8;
}

// The first escape of row `r`: its group's offset plus the escapes of the group's rows before it.
int64_t row_escape(const Form& f, int64_t r) {
  int64_t at = f.offsets[r / kGroup];
  const int64_t blocks = f.kp / kInputs;
  for (int64_t q = r / kGroup * kGroup; q < r; ++q)
    for (int64_t b = 0; b < blocks; ++b) at += __builtin_popcountll(escaped(f.planes + (q * blocks + b) * 3));
  return at;
}

// Row `r` decoded into `out` (k values), plain loops; returns the escape index after it.
int64_t decode_row_scalar(const Form& f, int64_t r, int64_t esc, uint16_t* out) {
  const uint8_t* low = f.low_bytes + r * f.kp;
  const uint64_t* p = f.planes + r * (f.kp / kInputs) * 3;
  for (int64_t b = 0; b < f.kp / kInputs; ++b, p += 3)
    for (int at = 0; at < kInputs; ++at) {
      const int code = ((p[0] >> at) & 1) | (((p[1] >> at) & 1) << 1) | (((p[2] >> at) & 1) << 2);
      const uint8_t high = code == kEscape ? f.escapes[esc++] : f.table[code];
      const int64_t i = b * kInputs + input_of(at);
      if (i < f.k) out[i] = static_cast<uint16_t>((high << 8) | low[b * kInputs + at]);
    }
  return esc;
}

#if EDGEINFER_X86
// The decoder's constants: the table's high bytes in the first 8 lanes; `spread` and `select` turn a block's
// three planes into its codes (decode64).
struct Consts {
  __m512i table, spread, select;
};

EDGEINFER_TARGET_LOSSLESS inline Consts consts_of(const Form& f) {
  alignas(64) uint8_t table[64] = {}, spread[64] = {}, select[64];
  for (int i = 0; i < 8; ++i) table[i] = f.table[i];
  for (int q = 0; q < 8; ++q)
    for (int j = 0; j < 8; ++j) {
      // qword q of the matrices: byte 7 - b is byte q of plane b (the planes' qwords lie at bytes 0, 8, 16)
      if (j >= 5) spread[q * 8 + j] = static_cast<uint8_t>((7 - j) * 8 + q);
      select[q * 8 + j] = static_cast<uint8_t>(1u << j);
    }
  return {_mm512_load_si512(table), _mm512_load_si512(spread), _mm512_load_si512(select)};
}

// One block of 64 weights as bf16 bits: inputs 0-31 in `lo`, 32-63 in `hi`; advances `esc` past its escapes.
EDGEINFER_TARGET_LOSSLESS inline void decode64(const Consts& c, const uint8_t* low, const uint64_t* p,
                                               const uint8_t*& esc, __m512i& lo, __m512i& hi) {
  // The codes: lane 8q + j needs bit j of byte q of each plane. One byte shuffle makes qword q an 8 x 8 bit
  // matrix whose rows 7, 6, 5 are those bytes; `gf2p8affineqb` multiplies it by the one-hot byte 1 << j,
  // which picks column j: the lane's three bits. (Three masked adds from mask registers cost more: moving
  // the planes into mask registers is slow.) The escaped lanes' mask and count stay in general registers.
  const uint64_t x = escaped(p);
  // Two plain loads, not one masked load of the 24 bytes: a masked load waits on the stores before it (on
  // Zen 4 that stalled the decoding, and most of all the decoding interleaved with the tiles' products).
  const __m256i planes_256 = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
      _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 2)), 1);
  const __m512i planes = _mm512_castsi256_si512(planes_256);
  const __m512i rows = _mm512_maskz_permutexvar_epi8(0xE0E0E0E0E0E0E0E0ull, c.spread, planes);
  const __m512i code = _mm512_gf2p8affine_epi64_epi8(c.select, rows, 0);
  __m512i high = _mm512_permutexvar_epi8(code, c.table);
  high = _mm512_mask_expand_epi8(high, _cvtu64_mask64(x), _mm512_loadu_si512(esc));
  esc += _mm_popcnt_u64(x);
  const __m512i l = _mm512_loadu_si512(low);
  lo = _mm512_unpacklo_epi8(l, high);
  hi = _mm512_unpackhi_epi8(l, high);
}

// The masks of a row's last, partial block: its first 32 inputs and its second 32 (a chunk without any is
// not multiplied, as bf16_tiles.h's chains have no such chunk).
struct Tail {
  __mmask32 first, second;
};

inline Tail tail_of(const Form& f) {
  const int64_t left = f.k - (f.k & ~(kInputs - 1));
  const auto mask = [](int64_t n) { return static_cast<__mmask32>(n >= 32 ? ~0u : (1u << n) - 1); };
  return {mask(left), mask(std::max<int64_t>(0, left - 32))};
}

// Row `r` decoded into `out` (k values); returns the escape pointer after it.
EDGEINFER_TARGET_LOSSLESS const uint8_t* decode_row(const Form& f, const Consts& c, const Tail& t, int64_t r,
                                                    const uint8_t* esc, uint16_t* out) {
  const uint8_t* low = f.low_bytes + r * f.kp;
  const uint64_t* p = f.planes + r * (f.kp / kInputs) * 3;
  const int64_t body = f.k & ~(kInputs - 1);
  __m512i lo, hi;
  int64_t i = 0;
  for (; i < body; i += kInputs, p += 3) {
    decode64(c, low + i, p, esc, lo, hi);
    _mm512_storeu_si512(out + i, lo);
    _mm512_storeu_si512(out + i + 32, hi);
  }
  if (i < f.kp) {
    decode64(c, low + i, p, esc, lo, hi);
    _mm512_mask_storeu_epi16(out + i, t.first, lo);
    _mm512_mask_storeu_epi16(out + i + 32, t.second, hi);
  }
  return esc;
}

// One chunk of 32 inputs into a row's chain; `mask` zeroes the inputs past the row's end.
EDGEINFER_TARGET_LOSSLESS inline __m512 chunk(__m512 a, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(a, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}
EDGEINFER_TARGET_LOSSLESS inline __m512 chunk(__m512 a, __m512i w, const uint16_t* x, __mmask32 mask) {
  return _mm512_dpbf16_ps(a, (__m512bh)_mm512_maskz_mov_epi16(mask, w), (__m512bh)_mm512_maskz_loadu_epi16(mask, x));
}

// Weight row `r` against activation rows [0, M), its blocks decoded once, in registers, and multiplied by
// every activation row: M chains side by side (each a serial sum in bf16_tiles.h's order), whose vectors
// go to acc[m][n]. Returns the escape pointer after the row. (Two weight rows side by side keep more chains
// going and are a little faster on a matrix in cache, but much slower on one streamed from memory.)
template <int M>
EDGEINFER_TARGET_LOSSLESS const uint8_t* row_direct(const Form& f, const Consts& c, const Tail& t,
                                                    const uint16_t* x, int64_t r, const uint8_t* esc,
                                                    __m512 (&acc)[M][16], int64_t n) {
  const int64_t body = f.k & ~(kInputs - 1), k = f.k;
  const uint8_t* low = f.low_bytes + r * f.kp;
  const uint64_t* p = f.planes + r * (f.kp / kInputs) * 3;
  __m512 a[M];
  __m512i lo, hi;
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) a[m] = _mm512_setzero_ps();
  for (int64_t i = 0; i < body; i += kInputs, p += 3) {
    decode64(c, low + i, p, esc, lo, hi);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) a[m] = chunk(a[m], lo, x + m * k + i);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) a[m] = chunk(a[m], hi, x + m * k + i + 32);
  }
  if (body < f.kp) {
    decode64(c, low + body, p, esc, lo, hi);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) a[m] = chunk(a[m], lo, x + m * k + body, t.first);
    if (t.second)
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) a[m] = chunk(a[m], hi, x + m * k + body + 32, t.second);
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) acc[m][n] = a[m];
  return esc;
}

// Activation rows [0, M) against weight rows [n0, n0 + 16) (fewer at the end), each weight row decoded as
// it streams by (for one activation row: bf16_tiles.h's `tile_in_order`, chain for chain).
template <int M>
EDGEINFER_TARGET_LOSSLESS void rows_direct(const Form& f, const Consts& c, const Tail& t, const uint16_t* x,
                                           int64_t n0, float* out_f32, at::BFloat16* out_bf16) {
  const int64_t nb = std::min<int64_t>(kGroup, f.n - n0);
  const uint8_t* esc = f.escapes + f.offsets[n0 / kGroup];
  __m512 acc[M][16];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t n = 0; n < nb; ++n) esc = row_direct<M>(f, c, t, x, n0 + n, esc, acc, n);
  const __mmask16 lanes = static_cast<__mmask16>((1u << nb) - 1);
  for (int m = 0; m < M; ++m) {
    const __m512 sums = edgeinfer_cpu::sum_lanes16(acc[m]);
    if (out_f32)
      _mm512_mask_storeu_ps(out_f32 + m * f.n + n0, lanes, sums);
    else
      _mm256_mask_storeu_epi16(out_bf16 + m * f.n + n0, lanes, edgeinfer_cpu::bf16_bits(sums));
  }
}

bool fast_variant() {
  static const bool vbmi = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512vbmi2") &&
           __builtin_cpu_supports("gfni") && __builtin_cpu_supports("popcnt");
  }();
  return vbmi && edgeinfer_cpu::isa_allows(edgeinfer_cpu::Isa::kAvx512Bf16);
}
#else
bool fast_variant() { return false; }
#endif

#if EDGEINFER_X86
EDGEINFER_TARGET_LOSSLESS void decode_rows_fast(const Form& f, int64_t r0, int64_t r1, uint16_t* out) {
  const Consts c = consts_of(f);
  const Tail t = tail_of(f);
  const uint8_t* esc = f.escapes + f.offsets[r0 / kGroup];
  for (int64_t r = r0; r < r1; ++r) esc = decode_row(f, c, t, r, esc, out + (r - r0) * f.k);
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
// Activation rows up to which weight blocks are multiplied as they are decoded; more rows decode into a
// buffer for the tiles, whose products then outweigh the decoding.
constexpr int64_t kDirectRows = 6;

template <int M>
EDGEINFER_TARGET_LOSSLESS void gemv_direct(const Form& f, const uint16_t* xs, float* out_f32,
                                           at::BFloat16* out_bf16) {
  const Consts c = consts_of(f);
  const Tail t = tail_of(f);
  const int64_t groups = (f.n + kGroup - 1) / kGroup;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kGroup * f.kp * 3 / 2));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) rows_direct<M>(f, c, t, xs, g * kGroup, out_f32, out_bf16);
  });
}

// Up to kDirectRows activation rows, each weight block decoded as it streams by.
void gemv_few_rows(const Form& f, const at::Tensor& x, at::Tensor& out) {
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* out_f32 = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  at::BFloat16* out_bf16 = out_f32 ? nullptr : out.data_ptr<at::BFloat16>();
  switch (x.size(0)) {
    case 1: return gemv_direct<1>(f, xs, out_f32, out_bf16);
    case 2: return gemv_direct<2>(f, xs, out_f32, out_bf16);
    case 3: return gemv_direct<3>(f, xs, out_f32, out_bf16);
    case 4: return gemv_direct<4>(f, xs, out_f32, out_bf16);
    case 5: return gemv_direct<5>(f, xs, out_f32, out_bf16);
    default: return gemv_direct<6>(f, xs, out_f32, out_bf16);
  }
}

// A side job of the tiles (bf16_tiles.h): decodes weight rows into a buffer of rows `kp` apart, one block
// of 64 every `every` steps of the tiles it rides along with, and fetches the compressed bytes kAhead blocks
// ahead of it. Interleaved with the products, the decoding's byte shuffles and interleaves run on vector
// ports the multiplier leaves idle; only its GF(2) product, mask move and expand take the multiplier's
// (docs/lossless-weights.md).
struct DecodeSide {
  const Consts* c;  // not the vectors themselves: a tile keeps a copy of the job in registers
  const uint8_t* low;
  const uint64_t* p;
  const uint8_t* esc;
  uint16_t* out;
  int64_t left;  // blocks still to decode
  int64_t every, count;

  // Rows [r0, r0 + rows) of `f` into `into`, the first escape at `first_escape`.
  DecodeSide(const Form& f, const Consts& consts, int64_t r0, int64_t rows, const uint8_t* first_escape,
             uint16_t* into)
      : c(&consts),
        low(f.low_bytes + r0 * f.kp),
        p(f.planes + r0 * (f.kp / kInputs) * 3),
        esc(first_escape),
        out(into),
        left(rows * (f.kp / kInputs)),
        every(1),
        count(1) {}

  // One block in every `steps / left` steps: the whole job in `steps` where there are enough. Where the
  // tiles keep most of L1 in use (wide rows), the job's streams would evict their rows: it rides along
  // with none of the steps and decodes after them.
  void ride(int64_t steps, int64_t tiles_l1_bytes) {
    const bool room = tiles_l1_bytes <= kRideL1Bytes;
    count = every = room ? std::max<int64_t>(1, steps / std::max<int64_t>(1, left)) : steps + 1;
  }

  EDGEINFER_TARGET_LOSSLESS void step() {
    if (--count > 0) return;
    count = every;
    if (left > 0) one();
  }

  EDGEINFER_TARGET_LOSSLESS void finish() {
    while (left > 0) one();
  }

  EDGEINFER_TARGET_LOSSLESS void one() {
    _mm_prefetch(reinterpret_cast<const char*>(low + kAhead * kInputs), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + kAhead * 3), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(esc + kAhead * 3), _MM_HINT_T0);
    __m512i lo, hi;
    decode64(*c, low, p, esc, lo, hi);
    _mm512_storeu_si512(out, lo);
    _mm512_storeu_si512(out + 32, hi);
    low += kInputs;
    p += 3;
    out += kInputs;
    --left;
  }
};

// The calling thread's decode buffer of at least `values` bf16 values, 64-byte aligned as bf16 weights are
// (the tiles' loads split cache lines otherwise). Kept between calls and only grown: one allocated per call
// can be mapped afresh each time, which a small matrix's product feels.
uint16_t* thread_buffer(int64_t values) {
  struct Free {
    void operator()(uint16_t* p) const { std::free(p); }
  };
  thread_local std::unique_ptr<uint16_t, Free> buffer;
  thread_local int64_t capacity = 0;
  if (values > capacity) {
    const int64_t bytes = (values * 2 + 63) / 64 * 64;
    buffer.reset(static_cast<uint16_t*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(buffer, "lossless_gemv: out of memory");
    capacity = bytes / 2;
  }
  return buffer.get();
}

// Several activation rows: each task runs the bf16 tiles on a block of decoded weight rows (up to kBlock,
// fewer where rows are long: two blocks stay in L2) while they decode the next block into a second buffer
// (DecodeSide); what they leave of it is decoded after them. A task's first block is short (kFirst rows):
// nothing hides its decoding.
void gemv_rows(const Form& f, const at::Tensor& x, at::Tensor& out) {
  const auto* xs = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* out_f32 = out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr;
  at::BFloat16* out_bf16 = out_f32 ? nullptr : out.data_ptr<at::BFloat16>();
  const int64_t blocks = (f.n + kBlock - 1) / kBlock, m = x.size(0);
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kBlock * f.k * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    // two blocks of rows kp apart, every value the tiles read written first
    const int64_t block_rows = std::clamp(kBufferBytes / (f.kp * 2) / kGroup * kGroup, kGroup, kBlock);
    uint16_t* buffers = thread_buffer(2 * block_rows * f.kp);
    uint16_t* buffer[2] = {buffers, buffers + block_rows * f.kp};
    const int64_t end = std::min(f.n, b1 * kBlock);
    int64_t n0 = b0 * kBlock, rows = std::min(kFirst, end - n0);
    const Consts c = consts_of(f);
    DecodeSide first(f, c, n0, rows, f.escapes + f.offsets[n0 / kGroup], buffer[0]);
    first.finish();
    const uint8_t* esc = first.esc;
    for (int at = 0; rows > 0; at ^= 1) {
      const int64_t next = std::min(block_rows, end - n0 - rows);
      DecodeSide side(f, c, n0 + rows, next, esc, buffer[at ^ 1]);
      const tiles::Product p{xs, buffer[at], m, rows, f.k, out_f32 ? out_f32 + n0 : nullptr,
                             out_bf16 ? out_bf16 + n0 : nullptr, f.n, f.kp};
      side.ride(tiles::side_steps(p, 0, rows), tiles::tiles_l1_bytes(p));
      tiles::block(p, 0, rows, &side);
      side.finish();
      esc = side.esc;
      n0 += rows;
      rows = next;
    }
  });
}
#endif

}  // namespace

namespace edgeinfer_cpu {

void lossless_gemv_out(const at::Tensor& x, const at::Tensor& low, const at::Tensor& planes,
                       const at::Tensor& escapes, const at::Tensor& offsets, const at::Tensor& table,
                       at::Tensor& out) {
  check(x, low, planes, escapes, offsets, table);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == low.size(0) && out.is_contiguous() &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "lossless_gemv: out must be contiguous fp32 or bf16 [M, N]");
  const Form f = form_of(x.size(1), low, planes, escapes, offsets, table);
  if (x.size(0) == 0 || f.n == 0) return;
  const at::Tensor xc = x.contiguous();
#if EDGEINFER_X86
  if (fast_variant()) return xc.size(0) <= kDirectRows ? gemv_few_rows(f, xc, out) : gemv_rows(f, xc, out);
#endif
  bf16_gemv_out(xc, decode_all(f), out);
}

at::Tensor lossless_gemv(const at::Tensor& x, const at::Tensor& low, const at::Tensor& planes,
                         const at::Tensor& escapes, const at::Tensor& offsets, const at::Tensor& table) {
  at::Tensor out = at::empty({x.size(0), low.size(0)}, x.options());
  lossless_gemv_out(x, low, planes, escapes, offsets, table, out);
  return out;
}

// The bf16 weight [N, K] of a form whose rows hold `k` inputs.
at::Tensor lossless_decode(int64_t k, const at::Tensor& low, const at::Tensor& planes, const at::Tensor& escapes,
                           const at::Tensor& offsets, const at::Tensor& table) {
  check(at::empty({0, k}, at::kBFloat16), low, planes, escapes, offsets, table);
  return decode_all(form_of(k, low, planes, escapes, offsets, table));
}

// Rows `ids` (any shape, int64) of the bf16 weight -> [*ids.shape, k]: an embedding lookup.
at::Tensor lossless_rows(const at::Tensor& ids, int64_t k, const at::Tensor& low, const at::Tensor& planes,
                         const at::Tensor& escapes, const at::Tensor& offsets, const at::Tensor& table) {
  check(at::empty({0, k}, at::kBFloat16), low, planes, escapes, offsets, table);
  const Form f = form_of(k, low, planes, escapes, offsets, table);
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
      "lossless_gemv(Tensor x, Tensor low_bytes, Tensor planes, Tensor escapes, Tensor offsets, Tensor table) "
      "-> Tensor");
  m.def(
      "lossless_gemv_out(Tensor x, Tensor low_bytes, Tensor planes, Tensor escapes, Tensor offsets, "
      "Tensor table, Tensor(a!) out) -> ()");
  m.def(
      "lossless_decode(int k, Tensor low_bytes, Tensor planes, Tensor escapes, Tensor offsets, Tensor table) "
      "-> Tensor");
  m.def(
      "lossless_rows(Tensor ids, int k, Tensor low_bytes, Tensor planes, Tensor escapes, Tensor offsets, "
      "Tensor table) -> Tensor");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) {
  m.impl("lossless_gemv", edgeinfer_cpu::lossless_gemv);
  m.impl("lossless_gemv_out", edgeinfer_cpu::lossless_gemv_out);
  m.impl("lossless_decode", edgeinfer_cpu::lossless_decode);
  m.impl("lossless_rows", edgeinfer_cpu::lossless_rows);
}
