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
  // Prompts are prefilled in chunks of kPrefillChunk positions aligned to multiples of it, so
  // that a chunk's keys and values depend only on the tokens up to its end and on the chunk's
  // fixed shape: the full chunks of a prefix computed for one request are, bit for bit, those
  // any later request with that prefix would compute, and can be reused (the prefix cache).
  static constexpr int kPrefillChunk = 64;

  BatchDecoder(Model& model, int slots);
  int slots() const { return cache_.B; }
  int position(int slot) const { return cache_.length[size_t(slot)]; }
  int64_t cache_bytes() const { return cache_.bytes(); }
  const ModelConfig& config() const { return model_.config(); }

  // Starts a sequence of `domain` in `slot` with `tokens` (non-empty, at most the context),
  // keeping the first `reuse` positions the slot already holds (a multiple of kPrefillChunk,
  // less than tokens.size(); 0 forgets everything). Returns the logits [V] after the last token.
  // With prompt_logprobs (size tokens.size() - 1, reuse 0), entry i receives
  // log p(tokens[i+1] | tokens[..i]).
  const float* prefill(int slot, int domain, std::span<const int32_t> tokens,
                       float* prompt_logprobs = nullptr, int reuse = 0);
  // Copies the keys and values of the first n positions of slot `from` into slot `to`.
  void copy_prefix(int from, int to, int n);
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
