// Decoding several sequences at once (continuous batching, DESIGN §10): one KV cache with a row
// per slot, each row at its own length. A sequence starts in a free slot with prefill() (its
// whole prompt in one forward pass) and then advances one token per step() together with the
// other active slots, so a new sequence joins between two steps of the others.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "model/activations.h"
#include "model/model.h"

namespace sigma {

class BatchDecoder {
 public:
  BatchDecoder(Model& model, int slots);
  int slots() const { return cache_.B; }
  int position(int slot) const { return cache_.length[size_t(slot)]; }
  const ModelConfig& config() const { return model_.config(); }

  // Starts a sequence of `domain` in `slot` (forgetting what it held) with `tokens` (non-empty,
  // at most the context). Returns the logits [V] after the last token. With prompt_logprobs
  // (size tokens.size() - 1), entry i receives log p(tokens[i+1] | tokens[..i]).
  const float* prefill(int slot, int domain, std::span<const int32_t> tokens,
                       float* prompt_logprobs = nullptr);
  // Scores `tokens` (2 to context + 1 of them) without generating: logprobs[i] = log p(tokens[i+1]
  // | tokens[..i]) for i < size - 1, from one pass over all but the last token (an evaluation
  // window of context + 1 tokens fits). Leaves `slot` holding size - 1 positions.
  void score(int slot, int domain, std::span<const int32_t> tokens, float* logprobs);
  // Feeds tokens[i] to slots[i] (distinct slots, each prefilled with `domains[i]`) in one
  // forward pass; logits(i) is then the next-token distribution of slots[i].
  void step(std::span<const int> slots, std::span<const int> domains,
            std::span<const int32_t> tokens);
  const float* logits(int i) const;

 private:
  // One forward pass of `inputs` into `slot` (cleared first); token_loss[t] against next[t].
  void run_prompt(int slot, int domain, std::span<const int32_t> inputs, const int32_t* next);
  Model& model_;
  KvCache cache_;
  Batch batch_;
  Activations prefill_acts_;
  std::vector<Activations> step_acts_;  // [slots]: one per batch size, so none is resized
  Activations* last_ = nullptr;
  std::vector<float> loss_;
  std::vector<float> logits_;  // host copy of the last pass's logits rows (prefill: its last)
};

// log softmax of logits[V] at `id`, in double.
double token_logprob(const float* logits, int64_t V, int32_t id);

}  // namespace sigma
