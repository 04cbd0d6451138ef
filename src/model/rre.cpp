#include "model/rre.h"

#include <omp.h>

#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/error.h"
#include "kernels/ops.h"
#include "model/expert_executor.h"

namespace sigma {

namespace {

// Experts of slice s that hold rows.
std::vector<int> busy_experts(const RrePlan& p, const ExpertSlice& s) {
  std::vector<int> busy;
  for (int e = s.begin; e < s.end; ++e)
    if (p.rows(e) > 0) busy.push_back(e);
  return busy;
}

}  // namespace

void upload_order(RrePlan& p) {
  if (p.order_d.numel() != int64_t(p.order.size()))
    p.order_d = ops::empty(DType::I32, {int64_t(p.order.size())});
  ops::upload(p.order_d, p.order.data(), p.order.size() * sizeof(int32_t));
}

// Many small experts run better side by side: each runs its GEMMs on one thread instead of
// forking every GEMM and activation over all threads (a fork and a join per kernel call, 13 per
// expert and step). Each expert writes only its own rows and its own gradients, so the order
// never matters.
ExpertSlice whole_plan(const RrePlan& p) {
  const int E = int(p.start.size()) - 1;
  int busy = 0;
  for (int e = 0; e < E; ++e) busy += p.rows(e) > 0;
  return {0, E, busy >= 2 * omp_get_max_threads() && !omp_in_parallel()};
}

void grouped_plan(RrePlan& p, std::vector<int64_t> start) {
  p.start = std::move(start);
  const int64_t N = p.start.back();
  p.expert.resize(size_t(N));
  for (size_t e = 0; e + 1 < p.start.size(); ++e)
    std::fill(p.expert.begin() + p.start[e], p.expert.begin() + p.start[e + 1], int32_t(e));
  p.order.resize(size_t(N));
  std::iota(p.order.begin(), p.order.end(), 0);
  p.single = -1;
  upload_order(p);
}

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
  if (p.single < 0) upload_order(p);  // a single expert runs without a gather
}

void rre_forward(float* y, float* pre, float* act, float* gx, float* gy, const float* x,
                 const RreWeights& w, const RrePlan& p, const ExpertSlice& s, int64_t N,
                 int64_t d, int64_t f) {
  if (p.single >= 0) {  // one expert takes every row: no gather (and exactly the dense FFN)
    if (p.single >= s.begin && p.single < s.end)
      ffn_forward(y, pre, act, x, w.expert[size_t(p.single)], N, d, f);
    return;
  }
  // The slice's rows are contiguous in plan order: r0 .. r0 + n.
  const int64_t r0 = p.start[size_t(s.begin)], n = p.start[size_t(s.end)] - r0;
  const int32_t* order = p.order_d.dev<int32_t>() + r0;
  // gy starts as the rows of y, so each expert adds onto them in place and the scatter is a
  // plain copy: every row gets y + FFN(x) in the same arithmetic as the dense block.
  ops::gather_rows(gx + r0 * d, x, order, n, d);
  ops::gather_rows(gy + r0 * d, y, order, n, d);
  const std::vector<int> busy = busy_experts(p, s);
#pragma omp parallel for schedule(dynamic, 1) if (s.side_by_side)
  for (size_t i = 0; i < busy.size(); ++i) {
    const int e = busy[i];
    const int64_t at = p.start[size_t(e)], rows = p.rows(e);
    ffn_forward(gy + at * d, pre + at * f, act + at * f, gx + at * d, w.expert[size_t(e)], rows,
                d, f);
  }
  ops::scatter_rows(y, gy + r0 * d, order, n, d, /*accumulate=*/false);
}

void rre_backward(float* dx, float* gx, float* gdy, float* gdx, const float* dy,
                  const float* x, const float* pre, float* act, const RreWeights& w,
                  const RrePlan& p, const ExpertSlice& s, int64_t N, int64_t d, int64_t f) {
  if (p.single >= 0) {
    if (p.single >= s.begin && p.single < s.end)
      ffn_backward(dx, w.expert_grad[size_t(p.single)], dy, x, pre, act,
                   w.expert[size_t(p.single)], N, d, f);
    return;
  }
  const int64_t r0 = p.start[size_t(s.begin)], n = p.start[size_t(s.end)] - r0;
  const int32_t* order = p.order_d.dev<int32_t>() + r0;
  ops::gather_rows(gx + r0 * d, x, order, n, d);
  ops::gather_rows(gdy + r0 * d, dy, order, n, d);
  ops::fill(gdx + r0 * d, 0.0f, n * d);
  const std::vector<int> busy = busy_experts(p, s);
#pragma omp parallel for schedule(dynamic, 1) if (s.side_by_side)
  for (size_t i = 0; i < busy.size(); ++i) {
    const int e = busy[i];
    const int64_t at = p.start[size_t(e)], rows = p.rows(e);
    ffn_backward(gdx + at * d, w.expert_grad[size_t(e)], gdy + at * d,
                 gx + at * d, pre + at * f, act + at * f, w.expert[size_t(e)], rows, d, f);
  }
  ops::scatter_rows(dx, gdx + r0 * d, order, n, d, /*accumulate=*/true);
}

}  // namespace sigma

namespace sigma {

void LocalExperts::forward(int block, const RreWeights& w, const RrePlan& p,
                           const ExpertBuffers& b, float* y, const float* x, int64_t N, int64_t d,
                           int64_t f) {
  for (int e = 0; e < w.experts(); ++e)
    SIGMA_CHECK(p.rows(e) == 0 || w.expert[size_t(e)].bound(),
                "block {}: expert {} receives tokens but is not bound (not in the step's active "
                "set)", block, e);
  rre_forward(y, b.pre, b.act, b.gx, b.gy, x, w, p, whole_plan(p), N, d, f);
}

void LocalExperts::backward(int, const RreWeights& w, const RrePlan& p, const ExpertBuffers& b,
                            float* dx, const float* dy, const float* x, int64_t N, int64_t d,
                            int64_t f) {
  rre_backward(dx, b.gx, b.gy, b.gdx, dy, x, b.pre, b.act, w, p, whole_plan(p), N, d,
               f);
}

}  // namespace sigma
