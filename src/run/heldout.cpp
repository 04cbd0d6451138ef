#include "run/heldout.h"

#include <algorithm>

#include "core/error.h"
#include "data/tokenizer.h"
#include "kernels/ops.h"

namespace sigma {

std::vector<DomainLoss> evaluate(Model& model, const DataSource& data, int B, int T,
                                 int rows_per_domain, const std::function<void(int rows)>& on_batch,
                                 std::span<const int32_t> token_bytes, Activations* acts,
                                 const EvalRanks* ranks) {
  // The source's domains are scored as the model's domains of the same names.
  const auto names = data.domains();
  std::vector<int32_t> to_model;
  for (const auto& n : names) to_model.push_back(model.config().domain_index(n));
  DomainSums sums(names.size());
  std::vector<int64_t> bytes(names.size(), 0);
  std::vector<float> token_loss;
  Batch mb;
  // A row's loss must not depend on the rows it is batched with (--batch, --domains): the
  // kernels' row-invariant paths (kernels/ops.h).
  const ops::BatchInvariant invariant;
  auto forward = [&](const Batch& b) {  // token_loss = b's losses
    mb = b;
    for (auto& d : mb.domain) d = to_model[size_t(d)];
    model.expert_executor().begin_step({&mb, 1});  // ECSS: bind the experts it routes to
    token_loss.resize(size_t(b.B) * b.T);
    if (acts)
      model.forward(mb, *acts, token_loss.data());
    else
      model.forward(mb, token_loss.data());
  };
  auto score = [&](const Batch& b) {  // b's token_loss into the sums, in order
    sums.add(b, token_loss);
    if (!token_bytes.empty())
      for (size_t i = 0; i < b.targets.size(); ++i) {
        if (b.mask[i] == 0.0f) continue;
        const int32_t t = b.targets[i];
        SIGMA_CHECK(t >= 0 && size_t(t) < token_bytes.size(), "held-out data: token id {} is "
                    "outside the tokenizer's {} ids", t, token_bytes.size());
        bytes[size_t(b.domain[i / size_t(b.T)])] += token_bytes[size_t(t)];
      }
    if (on_batch) on_batch(b.B);
  };
  if (!ranks || ranks->size <= 1) {
    data.eval_batches(B, T, rows_per_domain, [&](const Batch& b) {
      forward(b);
      score(b);
    });
  } else {
    const size_t R = size_t(ranks->size), slot = size_t(B) * size_t(T);
    std::vector<Batch> round;  // up to R batches, the k-th for rank k
    std::vector<float> mine(slot), all(R * slot);
    auto run_round = [&] {
      const size_t k = size_t(ranks->rank);
      forward(round[k < round.size() ? k : 0]);
      std::fill(mine.begin(), mine.end(), 0.0f);
      if (k < round.size()) std::copy(token_loss.begin(), token_loss.end(), mine.begin());
      ranks->all_gather(all.data(), mine.data(), slot);
      for (size_t q = 0; q < round.size(); ++q) {
        const size_t n = size_t(round[q].B) * size_t(round[q].T);
        token_loss.assign(all.begin() + std::ptrdiff_t(q * slot), all.begin() + std::ptrdiff_t(q * slot + n));
        score(round[q]);
      }
      round.clear();
    };
    data.eval_batches(B, T, rows_per_domain, [&](const Batch& b) {
      round.push_back(b);
      if (round.size() == R) run_round();
    });
    if (!round.empty()) run_round();
  }
  std::vector<DomainLoss> out;
  for (size_t d = 0; d < names.size(); ++d) {
    out.push_back({names[d], sums.count[d] ? sums.loss[d] / double(sums.count[d]) : 0.0,
                   sums.count[d], data.optimum(int(d), T), sums.loss[d], std::nullopt});
    if (!token_bytes.empty()) out.back().bytes = bytes[d];
  }
  return out;
}

std::vector<int32_t> token_byte_counts(const std::string& tokenizer_path) {
  const data::Tokenizer tok = data::Tokenizer::load(tokenizer_path);
  std::vector<int32_t> n(tok.vocab_size(), 0);
  for (uint32_t id = tok.n_controls(); id < tok.vocab_size(); ++id)
    n[id] = int32_t(tok.token_bytes(id).size());
  return n;
}

}  // namespace sigma
