// The kernels that other kernels call directly (dense_step.cpp runs a whole decode step through them),
// each also registered as a torch op by the file that defines it.

#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace edgeinfer_cpu {

// decode_ops.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool round_first);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t rd, bool interleaved);
at::Tensor gated_act(const at::Tensor& gate_up, int64_t act);
// k_scales / v_scales: the fp32 scales of int8 / float8 pools (kv_codes.h); none for bf16 pools.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                        const at::Tensor& block_tables, const at::Tensor& ctx_lens, double scale, int64_t window,
                        const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales);
at::Tensor paged_decode_latent(const at::Tensor& q, const at::Tensor& latent_pool, const at::Tensor& block_tables,
                               const at::Tensor& ctx_lens, int64_t rank, double scale);

// kv_write.cpp
// x [tokens, heads, dim] bf16 written at the flat `slots` of a paged pool [blocks, block_size, heads, dim]:
// into a bf16 pool as it is, into an int8 / float8 pool quantized per (token, head) as quant/kv.py
// quantizes it, the scales into `scales` [blocks, block_size, heads, 1] (undefined for a bf16 pool).
void write_kv(const at::Tensor& pool, const at::Tensor& scales, const int64_t* slots, int64_t tokens,
              const at::Tensor& x);

// mla_decode.cpp
at::Tensor mla_decode(const at::Tensor& q_nope, const at::Tensor& q_pe, const at::Tensor& latent_pool,
                      const at::Tensor& kv_b, const at::Tensor& block_tables, const at::Tensor& ctx_lens,
                      double scale);

// bf16_gemv.cpp
void bf16_gemv_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& out);
at::Tensor bf16_gemv(const at::Tensor& x, const at::Tensor& w);

// bf16_tiles.cpp (x86; AVX512-BF16 only)
void bf16_tiles_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& out);

// lossless_gemv.cpp: a bf16 weight in the lossless resident form (kernels/lossless.py), read where it lies
void lossless_gemv_out(const at::Tensor& x, const at::Tensor& low_bytes, const at::Tensor& planes,
                       const at::Tensor& escapes, const at::Tensor& offsets, const at::Tensor& table,
                       at::Tensor& out);
at::Tensor lossless_gemv(const at::Tensor& x, const at::Tensor& low_bytes, const at::Tensor& planes,
                         const at::Tensor& escapes, const at::Tensor& offsets, const at::Tensor& table);
at::Tensor lossless_decode(int64_t k, const at::Tensor& low_bytes, const at::Tensor& planes,
                           const at::Tensor& escapes, const at::Tensor& offsets, const at::Tensor& table);

// cpu_gemv.cpp
at::Tensor int4_gemv(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const at::Tensor& zero_terms, int64_t group);
// Rows start[e] .. start[e + 1] of bf16 x [R, K] times expert e of an int4 stack (codes [E, N/16, K/8, 64],
// scales and zero terms [E, N/16, K/G, 16]) -> bf16 [R, N], each row as int4_gemv computes it, every
// expert's products in one parallel region.
at::Tensor int4_gemv_grouped(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                             const at::Tensor& zero_terms, const std::vector<int64_t>& start, int64_t group);

// lora.cpp: out [T, N] += every adapter group's LoRA delta of x [T, in] at its `rows` (the layout of `a`,
// `b` and `plan`: engine/lora/weights.py and step.py)
void lora_add(at::Tensor& out, const at::Tensor& x_in, const at::Tensor& rows, at::TensorList a, at::TensorList b,
              const at::Tensor& plan);

}  // namespace edgeinfer_cpu
