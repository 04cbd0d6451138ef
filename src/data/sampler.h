// Sampler (DESIGN.md §5): which domain each batch row comes from, and which item (window or
// sample) of that domain. Domain draws are a pure function of (seed, step, row) through the
// counter-based RNG; items are read in a per-domain shuffled order, reshuffled every epoch.
// cursor() captures everything resume needs, so restore(cursor) continues the exact sequence.
#pragma once
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace sigma::data {

struct Stage {
  uint64_t steps = 0;  // length in steps; 0 = until the end (last stage only)
  std::vector<std::pair<std::string, double>> weights;  // used when !by_tokens
  bool by_tokens = true;             // weight each domain by its token count...
  std::vector<std::string> domains;  // ...over these domains (empty = all)
};

struct SamplerConfig {
  uint64_t seed = 1234;
  std::vector<Stage> stages;  // empty = one stage over every domain, by token count
  // Every row of a batch (a micro-batch) from one domain, drawn per batch with the stage's
  // weights: the paper's per-domain data streams. A step of several micro-batches still mixes
  // domains, but each micro-batch activates one expert group (ECSS under a memory budget
  // gathers a group's experts per micro-batch instead of every group's).
  bool one_domain_per_batch = false;
  // Batches (micro-batches) per optimizer step: train.accum, all ranks together. Stage lengths
  // count optimizer steps, so a stage of S steps lasts S x batches_per_step batches at any
  // rank count. Set by the run, not read from JSON.
  uint64_t batches_per_step = 1;

  // {"seed": 1, "stages": [{"steps": 500, "weights": {"english": 1, "chinese": 1}}, {}],
  //  "one_domain_per_batch": false};
  // a stage may give "domains": [names] instead of "weights" (weighted by token count).
  static SamplerConfig from_json(const nlohmann::json& j, const std::string& where);
  nlohmann::json to_json() const;
};

class Sampler {
 public:
  struct Pick {
    uint32_t domain;  // index into the names given to the constructor
    uint64_t item;    // window or sample index within that domain
  };
  // items[d]: windows (or samples) domain d offers; tokens[d]: its size, for default weights.
  Sampler(SamplerConfig cfg, std::vector<std::string> names, std::vector<uint64_t> items,
          std::vector<uint64_t> tokens);

  void next_batch(uint32_t rows, std::vector<Pick>& out);  // advances step() by one
  // Batch s draws its rows only from the domains allowed[s % allowed.size()] (indices into the
  // names), with the stage's weights among them (expert parallelism by group: each micro-batch
  // of a step belongs to one expert group). Empty = every domain.
  void restrict_batches(std::vector<std::vector<uint32_t>> allowed);
  uint64_t step() const { return step_; }
  size_t stage_at(uint64_t batch) const;  // the stage of batch number `batch` (step() counts batches)
  const std::vector<double>& probabilities(size_t stage) const { return prob_.at(stage); }

  nlohmann::json cursor() const;
  void restore(const nlohmann::json& cursor);  // throws if it was saved for other data or seed
  // After restore: the next batch is number `batch` (a resume whose micro-batches are cut
  // otherwise than the checkpoint's: the same optimizer step counted in the new batches, so
  // stages still end at their steps). The items continue where they were; the domain draws
  // of the batches from here are the new batch numbers'.
  void continue_at(uint64_t batch) { step_ = batch; }

 private:
  uint64_t next_item(uint32_t d);
  void shuffle(uint32_t d);

  SamplerConfig cfg_;
  std::vector<std::string> names_;
  std::vector<uint64_t> items_;
  std::vector<std::vector<double>> prob_, cum_;  // per stage, per domain
  std::vector<uint64_t> stage_end_;              // first batch after each stage
  uint64_t step_ = 0;
  std::vector<uint64_t> epoch_, pos_;
  std::vector<std::vector<uint32_t>> perm_;  // current epoch's order, per domain
  std::vector<std::vector<uint32_t>> allowed_;  // per batch slot; empty = all
};

}  // namespace sigma::data
