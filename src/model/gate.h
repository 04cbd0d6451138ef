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

#include "core/tensor.h"
#include "model/rre.h"
#include "model/weights.h"

namespace sigma {

// The host plans (capacity, the gathered layout, the loss) from the choices it downloads; the
// ops (kernels/ops.h, ops::gate_*) touch the tensors, which live on the device.
struct GatePlan {
  int k = 1;                       // experts per row (1 or 2; at most K_g)
  int Kmax = 1;                    // widest group: the row stride of probs
  // Device: what the ops read and write.
  Tensor probs;                    // [N, Kmax] gate softmax over the row's group
  Tensor choice_d, gate, pos_d;    // [N, 2] choices, combine weights, gathered rows (below)
  Tensor row_of_d;                 // [A] row_of
  Tensor width_d, base_d;          // [N] the row's group: its expert count, its first expert
  mutable Tensor aux_d;            // [E] backward scratch: d(aux term)/dp per expert, scaled
  // Host: the plan.
  std::vector<int32_t> choice;     // [N, 2] chosen expert (global index), -1 = none
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

// A gated block runs in pieces, so that its experts run through an ExpertExecutor (local, or
// on the ranks holding them) exactly as RRE experts do, over the gathered rows:
//   gate_route        gate softmax, top-k, capacity, the gathered layout and the aux loss;
//   gate_expert_plan  that layout as an RrePlan over the A gathered rows (identity order);
//   gate_gather       gx[A,d] = x[row_of[j]], the experts' input;
//   (the executor)    yg[A,d] = FFN_e(gx) per expert;
//   gate_combine      y[r] += gate * yg[pos].
// Backward: gate_expert_dy (the experts' dy and the gates' dot products), the executor's
// backward into gdx[A,d], then gate_backward_rest (dx through the combine, the softmax and the
// gate weights, with aux_scale = d(total loss)/d(aux) of this block).
void gate_route(GatePlan& p, float* z, const float* x, const RreWeights& w,
                const std::vector<PV>& gate_w, const int32_t* row_group, int k,
                float capacity_factor, int64_t N, int64_t d);
void gate_expert_plan(RrePlan& q, const GatePlan& p);
void gate_gather(float* gx, const GatePlan& p, const float* x, int64_t d);
void gate_combine(float* y, const float* yg, const GatePlan& p, int64_t N, int64_t d);
// gdy[A,d] = gate * dy[row]; dgate[N*2] = dy[row] . yg[pos] per kept choice (0 elsewhere).
void gate_expert_dy(float* gdy, float* dgate, const float* dy, const float* yg,
                    const GatePlan& p, int64_t N, int64_t d);
// dx[N,d] += gdx of each kept choice, plus the gate path; dz: scratch [N, Kmax].
void gate_backward_rest(float* dx, float* dz, const float* gdx, const float* dgate,
                        const float* x, const GatePlan& p, const RreWeights& w,
                        const std::vector<PV>& gate_w, const int32_t* row_group,
                        float aux_scale, int64_t N, int64_t d);

// The pieces composed with the experts run here (rre_forward over the gathered plan): a gated
// block in one call, for tests. y[N,d] += combined expert outputs; yg, gx [k*N,d]; pre, act
// [k*N,f]; scratch [2 k*N, d]; z [N,Kmax].
void gate_forward(float* y, float* yg, float* pre, float* act, float* gx, float* scratch,
                  float* z, GatePlan& p, const float* x, const RreWeights& w,
                  const std::vector<PV>& gate_w, const int32_t* row_group, int k,
                  float capacity_factor, int64_t N, int64_t d, int64_t f);

}  // namespace sigma
