// MLA's decode attention with the up-projection absorbed (attention/mla.py, "absorb"), in one call.
//
// Per head h, with kv_b_proj split into W_uk[h] [nope, rank] and W_uv[h] [v, rank]:
//   q_lat[h] = q_nope[h] W_uk[h]                  (the query moved into the latent space)
//   o_lat[h] = attention of [q_lat[h] ; q_pe[h]] over the cached latents [c ; k_pe], values c
//   out[h]   = W_uv[h] o_lat[h]
// In torch this is two batched matmuls over transposed views of kv_b_proj (which copy it every call) and a
// masked SDPA over a gather of every sequence's latents. Here each head's products read kv_b_proj where it
// lies, the heads in parallel, and the attention reads the latents in their blocks (paged_decode_latent).
// Products round to bf16 as a bf16 matmul does; the attention rounds as paged_decode does.

#include "isa.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using edgeinfer_cpu::bf16_bits_to_float;

// y[c] = bf16(sum_n x[n] w[n][c]) for c in [0, cols): a row times a row-major [n_in, cols] matrix whose rows
// are `ld` values apart.
void kn_row_scalar(const uint16_t* x, int64_t n_in, const uint16_t* w, int64_t ld, int64_t cols, uint16_t* y) {
  for (int64_t c = 0; c < cols; ++c) {
    float s = 0.f;
    for (int64_t n = 0; n < n_in; ++n) s += bf16_bits_to_float(x[n]) * bf16_bits_to_float(w[n * ld + c]);
    y[c] = c10::BFloat16(s).x;
  }
}

#if EDGEINFER_X86
EDGEINFER_TARGET_AVX512 void kn_row_avx512(const uint16_t* x, int64_t n_in, const uint16_t* w, int64_t ld,
                                           int64_t cols, uint16_t* y) {
  for (int64_t c0 = 0; c0 < cols; c0 += 64) {
    __mmask16 lanes[4];
    for (int j = 0; j < 4; ++j)
      lanes[j] = static_cast<__mmask16>((1u << std::clamp<int64_t>(cols - c0 - 16 * j, 0, 16)) - 1);
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    for (int64_t n = 0; n < n_in; ++n) {
      const __m512 xn = _mm512_set1_ps(bf16_bits_to_float(x[n]));
      for (int j = 0; j < 4; ++j)
        acc[j] = _mm512_fmadd_ps(xn, edgeinfer_cpu::bf16x16_to_fp32(w + n * ld + c0 + 16 * j, lanes[j]), acc[j]);
    }
    for (int j = 0; j < 4; ++j)
      _mm256_mask_storeu_epi16(y + c0 + 16 * j, lanes[j], edgeinfer_cpu::bf16_bits(acc[j]));
  }
}
#endif

void kn_row(const uint16_t* x, int64_t n_in, const uint16_t* w, int64_t ld, int64_t cols, uint16_t* y) {
#if EDGEINFER_X86
  if (edgeinfer_cpu::isa_allows(edgeinfer_cpu::Isa::kAvx512)) return kn_row_avx512(x, n_in, w, ld, cols, y);
#endif
  kn_row_scalar(x, n_in, w, ld, cols, y);
}

const uint16_t* bits(const at::Tensor& t) { return reinterpret_cast<const uint16_t*>(t.data_ptr<at::BFloat16>()); }
uint16_t* bits_mut(at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr<at::BFloat16>()); }

}  // namespace

namespace edgeinfer_cpu {

// q_nope [T, H, nope] and q_pe [T, H, rope] (rotated; any strides with unit inner stride), the step's new
// latents already in `latent_pool` [blocks, block_size, 1, rank + rope], `kv_b` [H * (nope + v), rank]
// (kv_b_proj's weight) -> [T, H, v].
at::Tensor mla_decode(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& latent_pool,
                      const at::Tensor& kv_b, const at::Tensor& block_tables, const at::Tensor& ctx_lens,
                      double scale) {
  TORCH_CHECK(q_nope.dim() == 3 && q_pe.dim() == 3 && q_nope.scalar_type() == at::kBFloat16 &&
                  q_pe.scalar_type() == at::kBFloat16 && q_nope.stride(2) == 1 && q_pe.stride(2) == 1,
              "mla_decode: q_nope and q_pe must be bf16 [T, heads, dim] with unit inner stride");
  const int64_t t = q_nope.size(0), heads = q_nope.size(1), nope = q_nope.size(2), rope = q_pe.size(2);
  const int64_t latent = latent_pool.size(3), rank = latent - rope;
  TORCH_CHECK(kv_b.dim() == 2 && kv_b.scalar_type() == at::kBFloat16 && kv_b.is_contiguous() &&
                  kv_b.size(1) == rank && kv_b.size(0) % heads == 0 && kv_b.size(0) / heads > nope,
              "mla_decode: kv_b must be contiguous bf16 [heads * (nope + v), rank]");
  const int64_t v = kv_b.size(0) / heads - nope;
  at::Tensor q = at::empty({t, heads, latent}, q_nope.options());
  q.narrow(2, rank, rope).copy_(q_pe);
  const uint16_t* w = bits(kv_b);
  uint16_t* qb = bits_mut(q);
  const uint16_t* qn = bits(q_nope);
  at::parallel_for(0, t * heads, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t row = i / heads, h = i % heads;
      kn_row(qn + row * q_nope.stride(0) + h * q_nope.stride(1), nope, w + h * (nope + v) * rank, rank, rank,
             qb + i * latent);
    }
  });
  const at::Tensor o_lat = paged_decode_latent(q, latent_pool, block_tables, ctx_lens, rank, scale);  // [T, H, rank]
  at::Tensor out = at::empty({t, heads, v}, q_nope.options());
  uint16_t* ob = bits_mut(out);
  // no in-place ATen op on the step's tensors in here: worker threads run outside the caller's inference mode
  at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      const at::Tensor w_uv = kv_b.narrow(0, h * (nope + v) + nope, v);  // [v, rank], contiguous
      const at::Tensor x = o_lat.select(1, h).contiguous();
      at::Tensor y = at::empty({t, v}, q_nope.options());
      bf16_gemv_out(x, w_uv, y);
      for (int64_t row = 0; row < t; ++row)
        std::memcpy(ob + (row * heads + h) * v, bits(y) + row * v, v * sizeof(uint16_t));
    }
  });
  return out;
}

}  // namespace edgeinfer_cpu

TORCH_LIBRARY_FRAGMENT(edgeinfer_cpu, m) {
  m.def(
      "mla_decode(Tensor q_nope, Tensor q_pe, Tensor latent_pool, Tensor kv_b, Tensor block_tables, "
      "Tensor ctx_lens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(edgeinfer_cpu, CPU, m) { m.impl("mla_decode", edgeinfer_cpu::mla_decode); }
