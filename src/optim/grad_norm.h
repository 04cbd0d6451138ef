// The global gradient norm, in one canonical order that does not depend on where the experts
// live (in the model, or in an expert store): every non-expert parameter in registration
// order, then every RRE expert in (block, group, expert) order, each expert's tensors in
// kExpertLeaves order (w_in, b_in, w_out, b_out). In-model, ECSS and vanilla-offload runs
// therefore clip by bit-identical factors, and vanilla offload trains bit for bit like
// in-model training.
#pragma once
#include <cstdint>
#include <vector>

#include "model/params.h"

namespace sigma {

// Sum of squares of x[0..n) in double: fixed chunks, each with 16 running sums (one per SIMD
// lane) added in a fixed order; chunks run on the OpenMP threads and are added in order. The
// same values give the same bits for any thread count.
double sum_sq(const float* x, int64_t n);
// The same sum over host memory (an expert store's gradients, which the CPU Adam reads there),
// by the cpu kernel behind ops::sum_sq: the bits of the in-model sum on the cpu backend.
double host_sum_sq(const float* x, int64_t n);

// A non-expert tensor adds one piece per slab: a run of its rows (dim 0) of about this many
// elements, at least one row. ZeRO cuts a tensor only on slab boundaries (parallel/
// shard_plan.h), so every piece has one owner and the fold is the same for any rank count.
constexpr int64_t kNormSlabElements = int64_t(1) << 16;
// Rows of p (dim 0; 1 for a scalar) and the rows of one of its slabs (an expert tensor
// stacked [K, ...]: one expert, whose pieces are its own).
int64_t param_rows(const Param& p);
int64_t slab_rows(const Param& p, int64_t slab);
// The pieces of non-expert param p.
int64_t norm_slabs(const Param& p, int64_t slab);

// Squared norm of the gradients of `ps` in the canonical order above (frozen or masked
// gradients are zero and add nothing). Expert tensors are stacked [K, ...] per (block, group).
double grad_sq(const ParamSet& ps, int64_t slab = kNormSlabElements);

// The pieces grad_sq adds, in its order: per non-expert tensor its slabs, then one per
// (expert, leaf). With `owned` ([params], ZeRO: what this rank owns of each) the pieces this
// rank does not own are 0, so a sum over ranks is exact and its left fold equals the one-rank
// grad_sq bit for bit.
std::vector<double> grad_sq_parts(const ParamSet& ps, const std::vector<ParamPiece>& owned = {},
                                  int64_t slab = kNormSlabElements);
double fold(const std::vector<double>& parts);

}  // namespace sigma
