// The learned-gate baseline (DESIGN §2) that RRE is measured against: in the same expert
// block, a row's domain still picks its group, but a learned gate W_g [d, K_g] picks the
// expert(s) instead of the routing table.
//   top-1 (Switch): p = softmax(x W_g); expert e1 = argmax p; y += p[e1] * FFN_e1(x).
//   top-2 (GShard): e1, e2 the two largest; y += (p1 FFN_e1(x) + p2 FFN_e2(x)) / (p1 + p2).
// Capacity: per group, each expert takes at most C = ceil(capacity_factor * k * n_g / K_g) of
// the batch's n_g rows of that group; first choices are placed before second choices, rows in
// order, and what does not fit is dropped (the residual carries the row on).
// Load-balancing loss (Switch): aux = sum_g (n_g / N) * K_g * sum_e f_e * P_e, with f_e the
// fraction of the group's rows whose first choice is e and P_e the mean of p_e over them; the
// model adds aux_loss_weight * aux per gated block, its gradient reaching the gate through P.
#pragma once
#include <cstdint>
#include <vector>

#include "model/weights.h"

namespace sigma {

struct GatePlan {
  int k = 1;                       // experts per row (1 or 2; at most K_g)
  int Kmax = 1;                    // widest group: the row stride of probs
  std::vector<float> probs;        // [N, Kmax] gate softmax over the row's group
  std::vector<int32_t> choice;     // [N, 2] chosen expert (global index), -1 = none
  std::vector<float> gate;         // [N, 2] combine weight of each choice
  std::vector<int32_t> pos;        // [N, 2] row in the gathered buffers, -1 = dropped / none
  std::vector<int32_t> row_of;     // [A] row of gathered assignment j
  std::vector<int64_t> start;      // [E+1] expert e holds gathered rows start[e] .. start[e+1]
  std::vector<double> top1;        // [E] rows whose first choice is e (before capacity)
  std::vector<int64_t> group_rows; // [G] rows per group
  int64_t assigned = 0;            // A, kept (row, expert) pairs
  int64_t dropped = 0;             // (row, choice) pairs over capacity
  double aux = 0;                  // this block's load-balancing loss (before the weight)
  int64_t rows(int e) const { return start[size_t(e) + 1] - start[size_t(e)]; }
};

// Forward of a gated expert block over N rows. y[N,d] += combined expert outputs.
// yg [k*N, d] keeps each expert's output (backward needs it); pre, act [k*N, f]; gx: scratch
// [k*N, d]; z: scratch [N, Kmax].
void gate_forward(float* y, float* yg, float* pre, float* act, float* gx, float* z, GatePlan& p,
                  const float* x, const RreWeights& w, const std::vector<PV>& gate_w,
                  const int32_t* row_group, int k, float capacity_factor, int64_t N, int64_t d,
                  int64_t f);

// Backward: accumulates dx[N,d], the experts' and the gates' gradients, with aux_scale =
// d(total loss)/d(aux) of this block. scratch: 2*k*N*f; gx, gdy, gdx: [k*N, d]; dz: [N, Kmax].
void gate_backward(float* dx, float* scratch, float* gx, float* gdy, float* gdx, float* dz,
                   const float* dy, const float* x, const float* yg, const float* pre,
                   const float* act, const GatePlan& p, const RreWeights& w,
                   const std::vector<PV>& gate_w, const int32_t* row_group, float aux_scale,
                   int64_t N, int64_t d, int64_t f);

}  // namespace sigma
