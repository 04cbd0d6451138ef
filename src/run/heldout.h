// Held-out loss per domain: what the training loop reports at its evaluations and the end,
// and what `sigma eval` prints for a checkpoint (which must not need the training layer).
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "model/batch.h"
#include "model/model.h"
#include "run/data_source.h"

namespace sigma {

struct DomainLoss {
  std::string name;
  double loss = 0;
  int64_t tokens = 0;
  std::optional<double> optimum;
};

// Per-domain sums of masked token losses.
struct DomainSums {
  std::vector<double> loss;
  std::vector<int64_t> count;
  explicit DomainSums(size_t n) : loss(n, 0.0), count(n, 0) {}
  void add(const Batch& b, const std::vector<float>& token_loss) {
    for (int r = 0; r < b.B; ++r)
      for (int t = 0; t < b.T; ++t) {
        const size_t i = size_t(r) * b.T + t;
        if (b.mask[i] == 0.0f) continue;
        loss[b.domain[r]] += token_loss[i];
        count[b.domain[r]] += 1;
      }
  }
  void add(const std::vector<double>& l, const std::vector<int64_t>& c) {
    for (size_t d = 0; d < loss.size(); ++d) loss[d] += l[d], count[d] += c[d];
  }
  double total_mean() const {
    double l = 0;
    int64_t c = 0;
    for (size_t i = 0; i < loss.size(); ++i) l += loss[i], c += count[i];
    return c ? l / double(c) : 0.0;
  }
};

// Mean masked loss per domain over the source's held-out batches (the model's expert
// executor makes each batch's experts usable first: ECSS binds them from its store).
// `on_batch(rows)` after each batch (progress). The passes run on `acts` (a training step's,
// between steps: no second set of buffers), else on the model's own.
std::vector<DomainLoss> evaluate(Model& model, const DataSource& data, int B, int T,
                                 int rows_per_domain,
                                 const std::function<void(int rows)>& on_batch = {},
                                 Activations* acts = nullptr);

}  // namespace sigma
