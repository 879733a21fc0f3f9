// bf16 products y[M, N] = x[M, K] @ W[N, K]^T on AVX512-BF16, for any number of rows: decode steps of
// one sequence or of many (kernels/bf16.py sends products of up to 64 rows; torch's GEMM is as fast on
// wider ones). The tiles and their order of sums: bf16_tiles.h. Work is split over threads by blocks of
// kBlock weight rows (a multiple of every NB).
//
// Prefetch: side by side, the first pass over a block (activation rows from 0) fetches the next weight
// tile into L2 (`prefetcht1`, a line per row per 32 inputs) while it multiplies this one. That is what
// takes the weight stream to the memory bandwidth: prefetching into L1 instead (`prefetcht0`) leaves the
// wider products no faster than no prefetch at all, and fetching further ahead than the next tile gains
// nothing. At one row the side-by-side reads cost more than reading the rows in order, hence the
// in-order reading of a single row (timings: docs/engine.md, docs/benchmarks.md).

#include "bf16_tiles.h"
#include "isa.h"
#include "ops.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if EDGEINFER_X86
namespace {

constexpr int64_t kBlock = 80;
constexpr int64_t kGrainBytes = 64 * 1024;

}  // namespace

namespace edgeinfer_cpu {

void bf16_tiles_out(const at::Tensor& x, const at::Tensor& w, at::Tensor& out) {
  const tiles::Product p{reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
                         reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()),
                         x.size(0),
                         w.size(0),
                         w.size(1),
                         out.scalar_type() == at::kFloat ? out.data_ptr<float>() : nullptr,
                         out.scalar_type() == at::kFloat ? nullptr : out.data_ptr<at::BFloat16>(),
                         w.size(0),
                         w.size(1)};
  const int64_t blocks = (p.n + kBlock - 1) / kBlock;
  const int64_t grain = std::max<int64_t>(1, kGrainBytes / (kBlock * p.k * 2));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) tiles::block(p, b * kBlock, std::min(p.n, (b + 1) * kBlock));
  });
}

}  // namespace edgeinfer_cpu
#endif
