#include "optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"
#include "kernels/ops.h"

namespace sigma {

void OptimConfig::describe(Options& o, const std::string& p) {
  o.add(p + "lr", &lr, "peak learning rate", 0.0, 10.0);
  o.add(p + "min_lr_ratio", &min_lr_ratio, "final lr as a fraction of the peak", 0.0, 1.0);
  o.add(p + "warmup", &warmup, "linear warm-up steps", 0, int64_t(1) << 40);
  o.add(p + "schedule_steps", &schedule_steps,
        "steps the warm-up + cosine schedule spans (0 = train.steps); set it to the original "
        "train.steps to extend a resumed run without changing its schedule",
        0, int64_t(1) << 40);
  o.add(p + "beta1", &beta1, "Adam beta1", 0.0, 0.99999);
  o.add(p + "beta2", &beta2, "Adam beta2", 0.0, 0.99999999);
  o.add(p + "eps", &eps, "Adam epsilon for shared parameters", 1e-30, 1.0);
  o.add(p + "eps_rre", &eps_rre, "Adam epsilon for RRE expert parameters", 1e-30, 1.0);
  o.add(p + "weight_decay", &weight_decay, "decoupled weight decay on linear weights", 0.0, 10.0);
  o.add(p + "grad_clip", &grad_clip, "global gradient-norm clip (0 = off)", 0.0, 1e9);
  o.add(p + "sparse_embeddings", &sparse_embeddings,
        "update only the embedding rows of the batch's tokens (inputs and targets), each with "
        "its own Adam step; drops the tied head's gradient on the other rows");
}

float lr_at(const OptimConfig& c, int64_t step, int64_t total) {
  if (c.schedule_steps > 0) total = c.schedule_steps;
  if (c.warmup > 0 && step < c.warmup) return c.lr * float(step + 1) / float(c.warmup);
  const int64_t span = std::max<int64_t>(1, total - c.warmup);
  const double progress = std::min(1.0, double(step - c.warmup) / double(span));
  const double floor = c.lr * c.min_lr_ratio;
  return float(floor + (c.lr - floor) * 0.5 * (1.0 + std::cos(M_PI * progress)));
}

AdamW::AdamW(const OptimConfig& cfg, const ParamSet& params, std::vector<ParamPiece> owned_pieces)
    : cfg_(cfg), owned_(std::move(owned_pieces)) {
  const auto& ps = params.all();
  SIGMA_CHECK(owned_.empty() || owned_.size() == ps.size(),
              "AdamW: ownership of {} entries for {} parameters", owned_.size(), ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    whole_.push_back(whole_param(params, i));
    const Shape& s = ps[i].value.shape();
    const int64_t n = ps[i].value.numel();
    width_.push_back(s.empty() || s[0] == 0 ? std::max<int64_t>(1, n) : n / s[0]);
    const ParamPiece mine = owned(i);
    SIGMA_CHECK(mine.param == i && 0 <= mine.begin && mine.begin <= mine.end && mine.end <= n &&
                    mine.begin % width_[i] == 0 && mine.end % width_[i] == 0,
                "AdamW: '{}' owned as elements [{}, {}) of {}, not whole rows of {}", ps[i].name,
                mine.begin, mine.end, n, width_[i]);
    Shape rows = s;  // beside the parameters, on the device
    if (!rows.empty()) rows[0] = mine.size() / width_[i];
    state_.push_back(owns(i) ? State{ops::empty(DType::F32, rows), ops::empty(DType::F32, rows), 0, {}}
                             : State{});
  }
}

int64_t AdamW::first_row(size_t i) const { return owned(i).begin / width_[i]; }

void UpdateMask::mask_grads(ParamSet& params) const {
  auto& ps = params.all();
  for (size_t i = 0; i < ps.size(); ++i) {
    float* g = ps[i].grad.dev_f();  // device memory: only ops touch it
    const int64_t n = ps[i].grad.numel();
    if (!frozen.empty() && frozen[i]) {
      ops::fill(g, 0.0f, n);
    } else if (!rows.empty() && !rows[i].empty()) {
      const int64_t width = n / ps[i].grad.dim(0);
      int64_t next = 0;  // zero the gaps between the kept row ranges (sorted)
      for (auto [b, e] : rows[i]) {
        ops::fill(g + next * width, 0.0f, (b - next) * width);
        next = e;
      }
      ops::fill(g + next * width, 0.0f, n - next * width);
    }
  }
}

void AdamW::lazy_row_step(size_t i, Param& p, State& s,
                          const std::vector<std::pair<int64_t, int64_t>>& ranges, float lr,
                          float eps, float grad_scale) {
  const int64_t width = width_[i], first = first_row(i), rows = owned(i).size() / width;
  if (s.row_step.empty()) s.row_step.assign(size_t(rows), s.step);  // rows so far moved together
  s.step += 1;  // counts the steps that updated any row
  std::vector<int64_t> list;
  for (auto [b, e] : ranges)
    for (int64_t r = std::max(b, first); r < std::min(e, first + rows); ++r) list.push_back(r);
  AdamStepArgs a = args(p, lr, eps, grad_scale, 0);
  float *w = p.value.dev_f(), *m = s.m.dev_f(), *v = s.v.dev_f();
  const float* g = p.grad.dev_f();
  const int64_t n = int64_t(list.size());
#pragma omp parallel for schedule(static) firstprivate(a) if (n * width > (int64_t(1) << 16))
  for (int64_t k = 0; k < n; ++k) {
    const int64_t r = list[size_t(k)], at = r - first;
    a.step = ++s.row_step[size_t(at)];
    ops::adam_step(w + r * width, m + at * width, v + at * width, g + r * width, width, a);
  }
}

AdamStepArgs AdamW::args(const Param& p, float lr, float eps, float grad_scale,
                         int64_t step) const {
  AdamStepArgs a;
  a.lr = lr;
  a.beta1 = cfg_.beta1;
  a.beta2 = cfg_.beta2;
  a.eps = eps;
  a.weight_decay = p.decay ? cfg_.weight_decay : 0.0f;
  a.grad_scale = grad_scale;
  a.step = step;
  return a;
}

void AdamW::step(ParamSet& params, float lr, float grad_scale, const UpdateMask* mask) {
  auto& ps = params.all();
  for (size_t i = 0; i < ps.size(); ++i) {
    if (!owns(i) || (mask && !mask->frozen.empty() && mask->frozen[i])) continue;
    State& s = state_[i];
    const float eps0 = ps[i].expert ? cfg_.eps_rre : cfg_.eps;
    if (mask && !mask->lazy_rows.empty() && mask->lazy_rows[i]) {
      lazy_row_step(i, ps[i], s, mask->rows.at(i), lr, eps0, grad_scale);
      continue;
    }
    s.step += 1;
    const AdamStepArgs a = args(ps[i], lr, eps0, grad_scale, s.step);
    const ParamPiece mine = owned(i);
    float *w = ps[i].value.dev_f(), *m = s.m.dev_f(), *v = s.v.dev_f();
    const float* g = ps[i].grad.dev_f();
    if (mask && !mask->rows.empty() && !mask->rows[i].empty()) {
      const int64_t width = width_[i], first = first_row(i), last = mine.end / width;
      for (auto [b, e] : mask->rows[i]) {
        b = std::max(b, first), e = std::min(e, last);
        if (b < e)
          ops::adam_step(w + b * width, m + (b - first) * width, v + (b - first) * width,
                         g + b * width, (e - b) * width, a);
      }
      continue;
    }
    ops::adam_step(w + mine.begin, m, v, g + mine.begin, mine.size(), a);
  }
}

}  // namespace sigma
