// LoRA deltas of a step's mixed batch, one call per targeted module (engine/lora/apply.py):
//
//   out[t, lo:hi] += (A_g x[t])[r0 : r0 + rank] @ B_g,s^T    for every token t of group g
//
// for every adapter group g of the step and every slice of the module that g targets (q/k/v of the fused
// qkv projection, gate/up of gate_up), in place. The step's tokens come as indices into x and out, grouped
// by adapter (`rows`; the base's tokens are in no group), so nothing is gathered or scattered in torch, and
// one call does every adapter's work: the per-adapter torch ops it replaces cost far more than the sums.
//
// Two passes, each over all groups at once (over the engine's threads where it reads enough weights):
//   shrink: h[i, :] = A_g x[rows[i]]                                 (fp32, a row of h per grouped token)
//   expand: out[rows[i], cols] += h[i, r0 : r0 + rank] @ B_g,s^T[:, cols]  (fp32 sums, rounded once into out)
// Tiles take up to kTokens tokens of one group, so each adapter row read serves them all. B comes
// transposed and cut into blocks of kBlock output columns, each block's [rank, kBlock] values together
// (engine/lora/weights.py): the expand pass multiplies broadcast h values along output columns, with no
// horizontal sums, and reads B start to end. Every sum runs in one order whatever tile or thread computes
// it, so a token's delta does not depend on the batch it came in.
//
// Variants (isa.h): AVX512-BF16 dot products for the shrink of bf16 tensors, AVX-512 FMAs on values
// widened to fp32 (bf16 or fp32 tensors), plain loops on any CPU.

#include "isa.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

using edgeinfer_cpu::bf16_bits_to_float;
using edgeinfer_cpu::Isa;

constexpr int kTokens = 4;     // tokens of a group per tile
constexpr int kRanks = 4;      // A rows per shrink tile: independent sums even for a single token
constexpr int64_t kBlock = 16;  // output columns per block of B
constexpr int kV = 4;           // blocks per expand tile
constexpr int64_t kCols = kV * kBlock;

// Output columns [lo, hi) of the module take h[r0, r0 + rank) times B's blocks from `block` on.
struct Slice {
  int64_t lo, hi, r0, block;
};

// One adapter's share of the call: its tokens rows[seg0, seg1), A [ranks, in], B [blocks, rank, kBlock].
struct Group {
  int64_t seg0, seg1;
  const void* a;
  const void* b;
  int64_t ranks, rank, blocks;
  std::vector<Slice> slices;
};

struct Call {
  const int64_t* rows;
  const void* x;
  int64_t ldx, in;
  void* out;
  int64_t ldo;
  float* h;  // [rows, ldh]
  int64_t ldh;
  std::vector<Group> groups;
};

// Tokens rows[i0, i1) of group g; A rows [k0, k1) (shrink) or slice s's columns [c0, c1) from lo (expand).
struct Tile {
  int64_t g, i0, i1, k0, k1;
  int64_t s, c0, c1;
};

// ---- plain loops ----------------------------------------------------------------------------------------
inline float to_float(float v) { return v; }
inline float to_float(uint16_t v) { return bf16_bits_to_float(v); }
inline void store_float(float* p, float v) { *p = v; }
inline void store_float(uint16_t* p, float v) { *p = c10::BFloat16(v).x; }

template <typename T>
void shrink_scalar(const Call& c, const Tile& t) {
  const Group& g = c.groups[t.g];
  const T* a = static_cast<const T*>(g.a);
  for (int64_t i = t.i0; i < t.i1; ++i) {
    const T* x = static_cast<const T*>(c.x) + c.rows[i] * c.ldx;
    for (int64_t k = t.k0; k < t.k1; ++k) {
      float s = 0.f;
      for (int64_t j = 0; j < c.in; ++j) s += to_float(x[j]) * to_float(a[k * c.in + j]);
      c.h[i * c.ldh + k] = s;
    }
  }
}

template <typename T>
void expand_scalar(const Call& c, const Tile& t) {
  const Group& g = c.groups[t.g];
  const Slice& s = g.slices[t.s];
  const T* b = static_cast<const T*>(g.b) + (s.block + t.c0 / kBlock) * g.rank * kBlock;
  float acc[kCols];
  for (int64_t i = t.i0; i < t.i1; ++i) {
    const float* h = c.h + i * c.ldh + s.r0;
    std::fill(acc, acc + kCols, 0.f);
    for (int64_t j = 0; j < g.rank; ++j)
      for (int64_t col = 0; col < t.c1 - t.c0; ++col)
        acc[col] += h[j] * to_float(b[(col / kBlock * g.rank + j) * kBlock + col % kBlock]);
    T* o = static_cast<T*>(c.out) + c.rows[i] * c.ldo + s.lo;
    for (int64_t col = t.c0; col < t.c1; ++col) store_float(o + col, to_float(o[col]) + acc[col - t.c0]);
  }
}

#if EDGEINFER_X86
// ---- AVX-512: fp32 FMAs, bf16 widened ---------------------------------------------------------------------
EDGEINFER_TARGET_AVX512_BASE inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
EDGEINFER_TARGET_AVX512_BASE inline __m512 load16(const uint16_t* p, __mmask16 m) {
  return edgeinfer_cpu::bf16x16_to_fp32(p, m);
}
EDGEINFER_TARGET_AVX512_BASE inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
EDGEINFER_TARGET_AVX512_BASE inline void store16(uint16_t* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, edgeinfer_cpu::bf16_bits(v));
}

inline __mmask16 lanes16(int64_t n) { return n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << std::max<int64_t>(n, 0)) - 1); }

// The tile's token rows of x, and its A rows (the last one repeated where fewer than kRanks are left: the
// repeats' sums are dropped).
template <typename T, int MT>
inline void tile_operands(const Call& c, const Tile& t, const T* (&xs)[MT], const T* (&as)[kRanks]) {
  const T* a = static_cast<const T*>(c.groups[t.g].a);
  for (int m = 0; m < MT; ++m) xs[m] = static_cast<const T*>(c.x) + c.rows[t.i0 + m] * c.ldx;
  for (int k = 0; k < kRanks; ++k) as[k] = a + std::min<int64_t>(t.k0 + k, t.k1 - 1) * c.in;
}

template <int MT>
EDGEINFER_TARGET_AVX512_BASE inline void store_sums(const Call& c, const Tile& t, const __m512 (&acc)[MT][kRanks]) {
  for (int m = 0; m < MT; ++m)
    for (int k = 0; k < kRanks && t.k0 + k < t.k1; ++k)
      c.h[(t.i0 + m) * c.ldh + t.k0 + k] = _mm512_reduce_add_ps(acc[m][k]);
}

template <typename T, int MT>
EDGEINFER_TARGET_AVX512 void shrink_avx512(const Call& c, const Tile& t) {
  const T* xs[MT];
  const T* as[kRanks];
  tile_operands<T, MT>(c, t, xs, as);
  __m512 acc[MT][kRanks];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t j = 0; j < c.in; j += 16) {
    const __mmask16 m16 = lanes16(c.in - j);
    __m512 xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = load16(xs[m] + j, m16);
    for (int k = 0; k < kRanks; ++k) {
      const __m512 av = load16(as[k] + j, m16);
      for (int m = 0; m < MT; ++m) acc[m][k] = _mm512_fmadd_ps(xv[m], av, acc[m][k]);
    }
  }
  store_sums<MT>(c, t, acc);
}

// bf16 pairs into fp32 lanes, 32 inputs an instruction.
template <int MT>
EDGEINFER_TARGET_BF16 void shrink_dpbf16(const Call& c, const Tile& t) {
  const uint16_t* xs[MT];
  const uint16_t* as[kRanks];
  tile_operands<uint16_t, MT>(c, t, xs, as);
  __m512 acc[MT][kRanks];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t j = 0; j < c.in; j += 32) {
    const int64_t left = std::min<int64_t>(c.in - j, 32);
    const __mmask32 m32 = left == 32 ? 0xFFFFFFFFu : static_cast<__mmask32>((1u << left) - 1);
    __m512bh xv[MT];
    for (int m = 0; m < MT; ++m) xv[m] = (__m512bh)_mm512_maskz_loadu_epi16(m32, xs[m] + j);
    for (int k = 0; k < kRanks; ++k) {
      const __m512bh av = (__m512bh)_mm512_maskz_loadu_epi16(m32, as[k] + j);
      for (int m = 0; m < MT; ++m) acc[m][k] = _mm512_dpbf16_ps(acc[m][k], xv[m], av);
    }
  }
  store_sums<MT>(c, t, acc);
}

template <typename T, int MT>
EDGEINFER_TARGET_AVX512 void expand_avx512(const Call& c, const Tile& t) {
  const Group& g = c.groups[t.g];
  const Slice& s = g.slices[t.s];
  // the tile's blocks (past the slice's last: its last again, masked off)
  const T* blocks[kV];
  __mmask16 mask[kV];
  for (int v = 0; v < kV; ++v) {
    mask[v] = lanes16(t.c1 - t.c0 - kBlock * v);
    const int64_t blk = s.block + (std::min<int64_t>(t.c0 + kBlock * v, t.c1 - 1)) / kBlock;
    blocks[v] = static_cast<const T*>(g.b) + blk * g.rank * kBlock;
  }
  const float* hs[MT];
  for (int m = 0; m < MT; ++m) hs[m] = c.h + (t.i0 + m) * c.ldh + s.r0;
  __m512 acc[MT][kV];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_ps();
  for (int64_t j = 0; j < g.rank; ++j) {
    __m512 bv[kV];
    for (int v = 0; v < kV; ++v) bv[v] = load16(blocks[v] + j * kBlock, mask[v]);
    for (int m = 0; m < MT; ++m) {
      const __m512 hj = _mm512_set1_ps(hs[m][j]);
      for (int v = 0; v < kV; ++v) acc[m][v] = _mm512_fmadd_ps(hj, bv[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MT; ++m) {
    T* o = static_cast<T*>(c.out) + c.rows[t.i0 + m] * c.ldo + s.lo + t.c0;
    for (int v = 0; v < kV; ++v)
      if (mask[v]) store16(o + kBlock * v, _mm512_add_ps(load16(o + kBlock * v, mask[v]), acc[m][v]), mask[v]);
  }
}
#endif

using TileFn = void (*)(const Call&, const Tile&);

// The variant for a tile of `tokens` tokens (1 .. kTokens).
template <template <typename, int> class Pick, typename T>
TileFn by_tokens(int64_t tokens) {
  switch (tokens) {
    case 1: return Pick<T, 1>::fn;
    case 2: return Pick<T, 2>::fn;
    case 3: return Pick<T, 3>::fn;
    default: return Pick<T, kTokens>::fn;
  }
}

#if EDGEINFER_X86
template <typename T, int MT>
struct ShrinkAvx512 {
  static constexpr TileFn fn = shrink_avx512<T, MT>;
};
template <typename T, int MT>
struct ShrinkDpbf16 {
  static constexpr TileFn fn = shrink_dpbf16<MT>;
};
template <typename T, int MT>
struct ExpandAvx512 {
  static constexpr TileFn fn = expand_avx512<T, MT>;
};
#endif

template <typename T>
TileFn shrink_fn(int64_t tokens) {
#if EDGEINFER_X86
  if constexpr (std::is_same_v<T, uint16_t>)
    if (edgeinfer_cpu::isa_allows(Isa::kAvx512Bf16)) return by_tokens<ShrinkDpbf16, T>(tokens);
  if (edgeinfer_cpu::isa_allows(Isa::kAvx512)) return by_tokens<ShrinkAvx512, T>(tokens);
#endif
  return shrink_scalar<T>;
}

template <typename T>
TileFn expand_fn(int64_t tokens) {
#if EDGEINFER_X86
  if (edgeinfer_cpu::isa_allows(Isa::kAvx512)) return by_tokens<ExpandAvx512, T>(tokens);
#endif
  return expand_scalar<T>;
}

// Every group's tokens in tiles of up to kTokens, crossed with `parts(group)` pieces of its work.
template <typename Parts>
std::vector<Tile> tiles(const Call& c, Parts parts) {
  std::vector<Tile> out;
  for (int64_t g = 0; g < static_cast<int64_t>(c.groups.size()); ++g)
    for (int64_t i = c.groups[g].seg0; i < c.groups[g].seg1; i += kTokens)
      parts(g, [&](Tile t) {
        t.g = g, t.i0 = i, t.i1 = std::min(i + kTokens, c.groups[g].seg1);
        out.push_back(t);
      });
  return out;
}

// The adapter weights a tile reads: one contiguous range (A rows [k0, k1), or B's blocks of the columns).
struct Span {
  const char* p;
  int64_t bytes;
};
using SpanFn = Span (*)(const Call&, const Tile&, int64_t elem);

Span shrink_span(const Call& c, const Tile& t, int64_t elem) {
  return {static_cast<const char*>(c.groups[t.g].a) + t.k0 * c.in * elem, (t.k1 - t.k0) * c.in * elem};
}

Span expand_span(const Call& c, const Tile& t, int64_t elem) {
  const Group& g = c.groups[t.g];
  const int64_t block = g.slices[t.s].block + t.c0 / kBlock, blocks = (t.c1 - t.c0 + kBlock - 1) / kBlock;
  return {static_cast<const char*>(g.b) + block * g.rank * kBlock * elem, blocks * g.rank * kBlock * elem};
}

// Each adapter's weights are a few KiB per tile, fetched from memory (the base's weights stream between
// two calls), too little for the hardware prefetcher to get going: each thread keeps the weights of its
// next tiles, up to kAheadBytes, being fetched into L2 while it computes.
constexpr int64_t kAheadBytes = 16 * 1024;

// A thread takes at least this many bytes of adapter weights: waking the others costs about what reading
// this much from memory does, so one sequence's step (a few dozen KiB a module) runs on the calling thread.
constexpr int64_t kGrainBytes = 128 * 1024;

// The tiles over the engine's threads, each by the variant for its number of tokens.
void run_tiles(const Call& c, const std::vector<Tile>& work, TileFn (*pick)(int64_t), SpanFn span, int64_t elem) {
  TileFn fns[kTokens];
  for (int m = 0; m < kTokens; ++m) fns[m] = pick(m + 1);
  const int64_t n = static_cast<int64_t>(work.size());
  int64_t bytes = 0;
  for (const Tile& t : work) bytes += span(c, t, elem).bytes;
  const int64_t grain = std::max<int64_t>(1, n * kGrainBytes / std::max<int64_t>(bytes, 1));
  at::parallel_for(0, n, grain, [&](int64_t w0, int64_t w1) {
    int64_t next = w0, ahead = 0;
    for (int64_t w = w0; w < w1; ++w) {
      for (; next < w1 && ahead < kAheadBytes; ++next) {
        const Span sp = span(c, work[next], elem);
#if EDGEINFER_X86
        for (int64_t i = 0; i < sp.bytes; i += 64) _mm_prefetch(sp.p + i, _MM_HINT_T1);
#endif
        ahead += sp.bytes;
      }
      fns[work[w].i1 - work[w].i0 - 1](c, work[w]);
      ahead -= span(c, work[w], elem).bytes;
    }
  });
}

template <typename T>
void run(const Call& c) {
  const auto shrink = tiles(c, [&](int64_t g, auto add) {
    for (int64_t k = 0; k < c.groups[g].ranks; k += kRanks)
      add(Tile{0, 0, 0, k, std::min(k + kRanks, c.groups[g].ranks), 0, 0, 0});
  });
  run_tiles(c, shrink, shrink_fn<T>, shrink_span, sizeof(T));
  const auto expand = tiles(c, [&](int64_t g, auto add) {
    const auto& slices = c.groups[g].slices;
    for (int64_t s = 0; s < static_cast<int64_t>(slices.size()); ++s)
      for (int64_t col = 0; col < slices[s].hi - slices[s].lo; col += kCols)
        add(Tile{0, 0, 0, 0, 0, s, col, std::min(col + kCols, slices[s].hi - slices[s].lo)});
  });
  run_tiles(c, expand, expand_fn<T>, expand_span, sizeof(T));
}

// The groups from `plan` (per group: seg0, seg1, slice count, then lo, hi, r0, block per slice), checked
// against the tensors so that no index the kernel follows leaves them.
std::vector<Group> read_plan(const at::Tensor& plan, const at::TensorList a, const at::TensorList b, int64_t n_rows,
                             int64_t in, int64_t out_cols, at::ScalarType dtype) {
  TORCH_CHECK(plan.scalar_type() == at::kLong && plan.dim() == 1 && plan.is_contiguous(),
              "lora_add: plan must be a contiguous int64 vector");
  TORCH_CHECK(a.size() == b.size(), "lora_add: one A and one B per group");
  const int64_t* p = plan.data_ptr<int64_t>();
  const int64_t* end = p + plan.numel();
  std::vector<Group> groups;
  for (size_t g = 0; g < a.size(); ++g) {
    TORCH_CHECK(end - p >= 3, "lora_add: the plan is shorter than its groups");
    TORCH_CHECK(a[g].dim() == 2 && a[g].size(1) == in && a[g].is_contiguous() && a[g].scalar_type() == dtype,
                "lora_add: A must be contiguous [ranks, in] of x's dtype");
    TORCH_CHECK(b[g].dim() == 3 && b[g].size(2) == kBlock && b[g].is_contiguous() && b[g].scalar_type() == dtype,
                "lora_add: B must be contiguous [blocks, rank, 16] of x's dtype");
    Group grp{p[0], p[1], a[g].data_ptr(), b[g].data_ptr(), a[g].size(0), b[g].size(1), b[g].size(0), {}};
    TORCH_CHECK(0 <= grp.seg0 && grp.seg0 <= grp.seg1 && grp.seg1 <= n_rows, "lora_add: a segment leaves rows");
    const int64_t n_slices = p[2];
    p += 3;
    TORCH_CHECK(n_slices >= 0 && end - p >= 4 * n_slices, "lora_add: the plan is shorter than its slices");
    for (int64_t s = 0; s < n_slices; ++s, p += 4) {
      const Slice sl{p[0], p[1], p[2], p[3]};
      TORCH_CHECK(0 <= sl.lo && sl.lo <= sl.hi && sl.hi <= out_cols && 0 <= sl.r0 && sl.r0 + grp.rank <= grp.ranks &&
                      0 <= sl.block && sl.block + (sl.hi - sl.lo + kBlock - 1) / kBlock <= grp.blocks,
                  "lora_add: a slice leaves out, A or B");
      grp.slices.push_back(sl);
    }
    groups.push_back(std::move(grp));
  }
  TORCH_CHECK(p == end, "lora_add: the plan is longer than its groups");
  return groups;
}

}  // namespace

namespace edgeinfer_cpu {

// out [T, N] += the deltas of the groups in `plan` (x [T, in]; both bf16 or both fp32, out with unit inner
// stride); rows: int64 token indices, each group's a segment of them, no token in two groups.
void lora_add(at::Tensor& out, const at::Tensor& x_in, const at::Tensor& rows, at::TensorList a, at::TensorList b,
              const at::Tensor& plan) {
  const at::Tensor x = x_in.dim() == 2 && x_in.stride(1) != 1 ? x_in.contiguous() : x_in;
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat, "lora_add: x must be bf16 or fp32");
  TORCH_CHECK(x.dim() == 2 && out.dim() == 2 && x.size(0) == out.size(0) && out.stride(1) == 1 &&
                  out.scalar_type() == dtype,
              "lora_add: x [T, in] and out [T, N] of one dtype, out with unit inner stride");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(),
              "lora_add: rows must be a contiguous int64 vector");
  const int64_t n = rows.numel();
  const int64_t* r = rows.data_ptr<int64_t>();
  TORCH_CHECK(std::all_of(r, r + n, [&](int64_t v) { return 0 <= v && v < x.size(0); }), "lora_add: a row leaves x");
  Call c{r, x.data_ptr(), x.stride(0), x.size(1), out.data_ptr(), out.stride(0), nullptr, 0,
         read_plan(plan, a, b, n, x.size(1), out.size(1), dtype)};
  for (const auto& g : c.groups) c.ldh = std::max(c.ldh, g.ranks);
  std::vector<float> h(n * c.ldh);
  c.h = h.data();
  if (dtype == at::kBFloat16)
    run<uint16_t>(c);
  else
    run<float>(c);
}

}  // namespace edgeinfer_cpu

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def("lora_add(Tensor(a!) out, Tensor x, Tensor rows, Tensor[] a, Tensor[] b, Tensor plan) -> ()");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) { m.impl("lora_add", edgeinfer_cpu::lora_add); }
