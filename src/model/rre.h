// The Random Routed Experts FFN (DESIGN §2) over raw pointers: rows (tokens) are grouped by
// the expert their (group, token id) routes to, gathered contiguously, run through that
// expert's FFN (src/model/ffn.h: one GEMM per expert and layer), and scattered back. No gate,
// no capacity: every row goes through exactly one expert. Experts without rows are not
// touched, so their gradients stay exactly zero.
#pragma once
#include <cstdint>
#include <vector>

#include "core/tensor.h"

#include "model/weights.h"

namespace sigma {

// How one RRE block's N rows are grouped by expert; a pure function of (group, token id) per
// row, known before the forward pass.
struct RrePlan {
  std::vector<int32_t> expert;  // [N] expert of each row (global index, RreWeights::expert)
  std::vector<int32_t> order;   // [N] row indices by expert, rows in their original order
  Tensor order_d;               // [N] order on the device, for the gather and scatter ops
  std::vector<int64_t> start;   // [E+1] expert e holds order[start[e] .. start[e+1])
  int single = -1;              // the one expert holding every row (then order = identity)
  int64_t rows(int e) const { return start[size_t(e) + 1] - start[size_t(e)]; }
};

// Fills `p` for N rows: row i has input token tokens[i] and belongs to group row_group[i].
void rre_plan(RrePlan& p, const RreWeights& w, const int32_t* tokens, const int32_t* row_group,
              int64_t N);
// A plan of rows already grouped by expert (a learned gate's gathered rows): expert e holds
// rows start[e] .. start[e+1]; the order is the identity.
void grouped_plan(RrePlan& p, std::vector<int64_t> start);
// Copies a plan's host `order` into its device twin `order_d` (rre_plan and grouped_plan do;
// a plan built by hand must call it before the gather and scatter ops read it).
void upload_order(RrePlan& p);

// The experts [begin, end) of a block (global indices), run in one call; rows of the others are
// left alone. side_by_side: run the experts one per thread (else each forks over all threads),
// decided once for the whole plan (whole_plan) so that a slice's experts run exactly as in the
// whole pass and a pass split into slices (ECSS under a memory budget) gives the same bits.
struct ExpertSlice {
  int begin = 0, end = 0;
  bool side_by_side = false;
};
ExpertSlice whole_plan(const RrePlan& p);

// y[N,d] += FFN_{expert(i)}(x[i]) for every row i whose expert is in `s`. pre and act [N,f]
// are saved in plan order (row order when p.single >= 0). gx, gy: scratch [N,d].
void rre_forward(float* y, float* pre, float* act, float* gx, float* gy, const float* x,
                 const RreWeights& w, const RrePlan& p, const ExpertSlice& s, int64_t N,
                 int64_t d, int64_t f);

// Accumulates dx[N,d] over the rows of the experts in `s`, and those experts' gradients (+=).
// gx, gdy, gdx: [N,d] (overwritten); act's rows of those experts are overwritten (ffn_backward).
void rre_backward(float* dx, float* gx, float* gdy, float* gdx, const float* dy,
                  const float* x, const float* pre, float* act, const RreWeights& w,
                  const RrePlan& p, const ExpertSlice& s, int64_t N, int64_t d, int64_t f);

}  // namespace sigma
