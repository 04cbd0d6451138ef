// Held-out loss per domain: what the training loop reports at its evaluations and the end,
// and what `sigma eval` prints for a checkpoint (which must not need the training layer).
#pragma once
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "model/batch.h"
#include "model/model.h"
#include "run/data_source.h"

namespace sigma {

struct DomainLoss {
  std::string name;
  double loss = 0;  // mean nats per scored token
  int64_t tokens = 0;
  std::optional<double> optimum;
  double nats = 0;               // summed over the scored tokens
  std::optional<int64_t> bytes;  // of the scored tokens' text, when the tokenizer is known
  // nats / (ln 2 * bytes): comparable between models with different tokenizers.
  std::optional<double> bits_per_byte() const {
    if (!bytes || *bytes <= 0) return std::nullopt;
    return nats / (0.69314718055994530942 * double(*bytes));
  }
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

// The data-parallel ranks of a training run sharing an evaluation (run/ does not see dist/):
// all_gather(out, mine, n) gives every rank every rank's n floats, in rank order, in out.
struct EvalRanks {
  int rank = 0, size = 1;
  std::function<void(float* out, const float* mine, size_t n)> all_gather;
};

// Mean masked loss per domain over the source's held-out batches (the model's expert
// executor makes each batch's experts usable first: ECSS binds them from its store).
// `on_batch(rows)` after each batch (progress). `token_bytes` (indexed by token id; empty:
// none): the bytes each token's text has, summed over the scored targets into
// DomainLoss::bytes (token_byte_counts). The passes run on `acts` (a training step's, between
// steps: no second set of buffers), else on the model's own.
// With `ranks` (every one of them calling this alike) the batches are dealt round-robin: each
// round, every rank runs one batch (a rank past the last batch runs the round's first again
// and scores nothing: the passes are collective under ZeRO-3 and tensor parallelism), the
// round's token losses are all-gathered, and every rank adds them up in batch order as one
// process does, so the losses are the same bits on any rank count.
std::vector<DomainLoss> evaluate(Model& model, const DataSource& data, int B, int T,
                                 int rows_per_domain,
                                 const std::function<void(int rows)>& on_batch = {},
                                 std::span<const int32_t> token_bytes = {},
                                 Activations* acts = nullptr, const EvalRanks* ranks = nullptr);

// The UTF-8 bytes each id of the tokenizer file `path` decodes to, a control token counting
// none (its name is not text): the byte count of held-out windows of token ids.
std::vector<int32_t> token_byte_counts(const std::string& tokenizer_path);

}  // namespace sigma
