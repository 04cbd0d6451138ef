#include "model/rre.h"

#include <omp.h>

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/expert_executor.h"

namespace sigma {

namespace {

// Experts with rows, and whether to run them side by side, one per thread. Many small experts
// run better that way: each runs its GEMMs on one thread instead of forking every GEMM and
// activation over all threads (a fork and a join per kernel call, 13 per expert and step).
// Each expert writes only its own rows and its own gradients, so the order never matters.
struct Busy {
  std::vector<int> experts;
  bool side_by_side;
};
Busy busy_experts(const RrePlan& p, int E) {
  Busy b;
  for (int e = 0; e < E; ++e)
    if (p.rows(e) > 0) b.experts.push_back(e);
  b.side_by_side = int(b.experts.size()) >= 2 * omp_get_max_threads() && !omp_in_parallel();
  return b;
}

}  // namespace

void rre_plan(RrePlan& p, const RreWeights& w, const int32_t* tokens, const int32_t* row_group,
              int64_t N) {
  const int E = w.experts();
  p.expert.resize(size_t(N));
  p.order.resize(size_t(N));
  p.start.assign(size_t(E) + 1, 0);
  for (int64_t i = 0; i < N; ++i) {
    const int e = w.route(row_group[i], tokens[i]);
    p.expert[size_t(i)] = e;
    ++p.start[size_t(e) + 1];
  }
  p.single = -1;
  for (int e = 0; e < E; ++e) {
    if (p.start[size_t(e) + 1] == N) p.single = e;
    p.start[size_t(e) + 1] += p.start[size_t(e)];
  }
  // Counting sort, stable: rows of one expert keep their order (determinism).
  std::vector<int64_t> next(p.start.begin(), p.start.end() - 1);
  for (int64_t i = 0; i < N; ++i) p.order[size_t(next[size_t(p.expert[size_t(i)])]++)] = int32_t(i);
}

void rre_forward(float* y, float* pre, float* act, float* gx, float* gy, const float* x,
                 const RreWeights& w, const RrePlan& p, int64_t N, int64_t d, int64_t f) {
  if (p.single >= 0) {  // one expert takes every row: no gather (and exactly the dense FFN)
    ffn_forward(y, pre, act, x, w.expert[size_t(p.single)], N, d, f);
    return;
  }
  // gy starts as the rows of y, so each expert adds onto them in place and the scatter is a
  // plain copy: every row gets y + FFN(x) in the same arithmetic as the dense block.
  ops::gather_rows(gx, x, p.order.data(), N, d);
  ops::gather_rows(gy, y, p.order.data(), N, d);
  const Busy busy = busy_experts(p, w.experts());
#pragma omp parallel for schedule(dynamic, 1) if (busy.side_by_side)
  for (size_t i = 0; i < busy.experts.size(); ++i) {
    const int e = busy.experts[i];
    const int64_t s = p.start[size_t(e)], n = p.rows(e);
    ffn_forward(gy + s * d, pre + s * f, act + s * f, gx + s * d, w.expert[size_t(e)], n, d, f);
  }
  ops::scatter_rows(y, gy, p.order.data(), N, d, /*accumulate=*/false);
}

void rre_backward(float* dx, float* scratch, float* gx, float* gdy, float* gdx, const float* dy,
                  const float* x, const float* pre, const float* act, const RreWeights& w,
                  const RrePlan& p, int64_t N, int64_t d, int64_t f) {
  if (p.single >= 0) {
    ffn_backward(dx, w.expert_grad[size_t(p.single)], scratch, dy, x, pre, act,
                 w.expert[size_t(p.single)], N, d, f);
    return;
  }
  ops::gather_rows(gx, x, p.order.data(), N, d);
  ops::gather_rows(gdy, dy, p.order.data(), N, d);
  ops::fill(gdx, 0.0f, N * d);
  const Busy busy = busy_experts(p, w.experts());
#pragma omp parallel for schedule(dynamic, 1) if (busy.side_by_side)
  for (size_t i = 0; i < busy.experts.size(); ++i) {
    const int e = busy.experts[i];
    const int64_t s = p.start[size_t(e)], n = p.rows(e);
    // Each expert its own part of the scratch (2*n*f of the 2*N*f floats).
    ffn_backward(gdx + s * d, w.expert_grad[size_t(e)], scratch + 2 * s * f, gdy + s * d,
                 gx + s * d, pre + s * f, act + s * f, w.expert[size_t(e)], n, d, f);
  }
  ops::scatter_rows(dx, gdx, p.order.data(), N, d, /*accumulate=*/true);
}

}  // namespace sigma

namespace sigma {

void LocalExperts::forward(int block, const RreWeights& w, const RrePlan& p,
                           const ExpertBuffers& b, float* y, const float* x, int64_t N, int64_t d,
                           int64_t f) {
  for (int e = 0; e < w.experts(); ++e)
    SIGMA_CHECK(p.rows(e) == 0 || w.expert[size_t(e)].w_in,
                "block {}: expert {} receives tokens but is not bound (not in the step's active "
                "set)", block, e);
  rre_forward(y, b.pre, b.act, b.gx, b.gy, x, w, p, N, d, f);
}

void LocalExperts::backward(int, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b,
                            float* dx, const float* dy, const float* x, int64_t N, int64_t d,
                            int64_t f) {
  rre_backward(dx, b.scratch, b.gx, b.gy, b.gdx, dy, x, b.pre, b.act, w, p, N, d, f);
}

}  // namespace sigma
