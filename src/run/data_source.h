// Where batches come from. A training batch is a pure function of its global micro-batch
// index, so resuming at step k needs no cursor beyond k (and is exact).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "model/batch.h"
#include "run/config.h"

namespace sigma {

class DataSource {
 public:
  virtual ~DataSource() = default;
  virtual int vocab() const = 0;
  virtual std::vector<std::string> domains() const = 0;
  // Fills b (B rows of T) with training micro-batch number `index`.
  virtual void train_batch(Batch& b, int B, int T, uint64_t index) const = 0;
  // Calls fn on each held-out batch (rows of every domain).
  virtual void eval_batches(int B, int T, int rows_per_domain,
                            const std::function<void(const Batch&)>& fn) const = 0;
  // The best achievable loss per token for a domain, when the source knows it.
  virtual std::optional<double> optimum(int /*domain*/, int /*T*/) const { return std::nullopt; }
  // The data's domain registry (same order as domains()): group and embedding slot of each
  // domain; by default each domain is its own group, all on slot 0.
  virtual DomainRegistry domain_specs() const {
    DomainRegistry s;
    for (const auto& n : domains()) s.push_back({n, n, 0});
    return s;
  }
  // Tokenizer file behind the token ids ("" for the synthetic data) and its hash (0 = none).
  virtual std::string tokenizer_path() const { return ""; }
  virtual uint64_t tokenizer_hash() const { return 0; }
  // Position in a stateful stream (saved in checkpoints; null when batches are pure functions
  // of their index) and its restore.
  virtual nlohmann::json cursor() const { return nullptr; }
  // Training token counts [vocab] per domain name, for frequency-balanced routing tables
  // (empty when the source cannot count them).
  virtual std::map<std::string, std::vector<int64_t>> domain_token_counts(int /*vocab*/) const {
    return {};
  }
  virtual void restore(const nlohmann::json& /*cursor*/) {}
  // After restore(): training batch `index` is the next one. A resume that cuts the step's
  // rows into other micro-batches than the checkpoint's (another rank count, train.batch or
  // train.accum) counts the same step in other batches; returns the index the cursor was at.
  virtual uint64_t continue_at(uint64_t index) { return index; }
  // Training micro-batch i draws its rows only from the domains allowed[i % allowed.size()]
  // (indices into domains()): dist.placement = by_group. Empty = every domain.
  virtual void restrict_batches(std::vector<std::vector<uint32_t>> allowed);
  // (Re)starts the training stream for cfg.train's resolved batch shape and accumulation (a
  // stateless source needs none).
  virtual void start_training(const Config& /*cfg*/) {}
};

// The source named by cfg.data (throws naming the key on a bad choice), its training stream
// started from cfg.train unless `start_training` is false (the trainer opens the data before the
// rank grid resolves each rank's batch, then starts the stream).
std::unique_ptr<DataSource> make_data_source(const Config& cfg, bool start_training = true);

// Held-out windows of a directory made by `sigma prepare`, for evaluation only. `tokenizer_hash`
// (0 = unchecked) must match the shards'.
std::unique_ptr<DataSource> make_eval_source(const std::string& dir, uint64_t tokenizer_hash);

// "" when the token ids of `data` (the folder `data_dir`) come from the tokenizer stored in
// checkpoint `ckpt_dir`, or when either side has none (the synthetic data, a checkpoint trained
// on token ids); else one sentence naming both tokenizers (file, hash, size). An id of another
// tokenizer means another string even at the same vocabulary size, so `sigma eval` and `sigma
// train --resume` refuse such data, each adding what to do.
std::string tokenizer_mismatch(const std::string& ckpt_dir, const DataSource& data,
                               const std::string& data_dir);

// Fills in what the data decides and the config left open: vocab and the domain list. With a
// domain list in the config, every domain of the data must be one of the model's (the model
// may have more: an extract's parent data, or a new domain trained alone).
void bind_model_to_data(ModelConfig& m, const DataSource& d);

}  // namespace sigma
