// The serving engine (DESIGN §10): one model, `slots` sequences decoded together (continuous
// batching: queued requests are admitted between two decode steps), a bounded queue, and the
// counters /metrics reports. HTTP threads submit jobs and read their events from a Channel; the
// engine thread alone touches the model.
#pragma once
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "data/tokenizer.h"
#include "infer/batch_decoder.h"
#include "infer/generate.h"
#include "serve/json_prefix.h"

namespace sigma::serve {

// One token of choice `index`, or the end of that choice (finish_reason set).
struct TokenEvent {
  int index = 0;
  int32_t token = -1;                             // -1 on a finish event
  double logprob = 0;                             // log p(token), the model's distribution
  std::vector<std::pair<int32_t, double>> top;    // the top_logprobs most likely ids
  std::string finish_reason;                      // "stop" | "length" | "error" | "" (a token)
};

// What the engine tells one HTTP request (all its choices), and what the request tells it.
struct Channel {
  std::mutex m;
  std::condition_variable cv;
  std::deque<TokenEvent> events;
  std::vector<std::vector<float>> prompt_logprobs;  // [n][prompt-1] when asked for
  // [n] per choice: the client is gone, or a stop string matched; the engine frees its slot.
  std::unique_ptr<std::atomic<bool>[]> cancelled;
  const int n;
  std::string error;  // what ended a choice with "error" (set before that event is pushed)

  explicit Channel(int choices);
  void cancel_all();
  void push(TokenEvent e);
  // Waits up to `ms` for an event; nullopt on time-out.
  std::optional<TokenEvent> pop(int ms);
};

struct Job {
  int index = 0;  // choice index within its request
  int domain = 0;
  std::vector<int32_t> prompt;
  SamplingConfig s;                  // s.max_new_tokens may be 0 (score the prompt only)
  std::vector<int32_t> stop_tokens;  // a choice ends after emitting one of these
  int top_logprobs = -1;             // -1 = no logprobs; k >= 0: chosen token and top k
  bool prompt_logprobs = false;      // echo + logprobs: score the prompt's tokens
  std::vector<std::pair<int32_t, float>> logit_bias;  // added to the logits before sampling
  bool json_object = false;          // only tokens that keep the text a JSON object prefix
  std::chrono::steady_clock::time_point submitted = std::chrono::steady_clock::now();
  std::shared_ptr<Channel> out;
};

// A Prometheus histogram of seconds with fixed buckets (upper bounds, then +Inf).
struct Histogram {
  static constexpr std::array<double, 12> kBounds = {0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                                                     0.5,   1,    2.5,   5,    10,  30};
  std::array<int64_t, kBounds.size() + 1> counts{};  // per bucket, not cumulative
  double sum = 0;
  int64_t count = 0;
  void add(double seconds);
  // The metric's lines: NAME_bucket{le=...} (cumulative), NAME_sum, NAME_count.
  std::string prometheus(const std::string& name) const;
};

struct EngineStats {
  int64_t prompt_tokens = 0, generated_tokens = 0, decode_steps = 0, decode_tokens = 0;
  double decode_seconds = 0;  // time inside decode steps (not prefill)
  int busy_slots = 0, queued = 0;
  int64_t prefix_tokens_reused = 0;  // prompt positions whose keys and values came from the prefix cache
  Histogram time_to_first_token;  // a choice's submission to its first token
  Histogram inter_token;          // between two tokens of one choice
};

class Engine {
 public:
  // `tok` (may be null) gives the token bytes that json_object decoding checks. With
  // prefix_cache, a prompt that starts like one prefilled before (same domain) reuses the keys
  // and values of their common full prefill chunks (BatchDecoder::kPrefillChunk): the same bits
  // as computing them again, so outputs do not change.
  Engine(Model& model, int slots, int queue_limit, const data::Tokenizer* tok = nullptr,
         bool prefix_cache = true);
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Queues every job of one request, or none (false) when they do not fit in the queue.
  bool submit(std::vector<Job> jobs);
  // Finishes the queued and running jobs, then stops the engine thread.
  void shutdown();
  EngineStats stats() const;
  int slots() const { return decoder_.slots(); }

 private:
  struct Active {
    Job job;
    std::vector<int32_t> seq;  // prompt and the tokens generated so far
    int generated = 0;
    JsonPrefix json;           // the text so far, for json_object
    std::chrono::steady_clock::time_point last_token;
  };
  void loop();
  bool admit_waiting(std::vector<int>& fresh);
  void start(int slot);
  void step_all();
  // Samples, reports and ends (when due) the sequence in `slot` from its next-token logits.
  void advance(int slot, const float* logits);
  void finish(int slot, const char* reason);
  void fail(int slot, const std::string& what);

  // Sets the logits of tokens that cannot continue the slot's JSON object to -1e30.
  void mask_json(const Active& a, float* logits) const;

  // Prompt positions a prefill may take from the cache (a multiple of the chunk), and from
  // which slot; 0 when nothing is shared.
  std::pair<int, int> reusable(const Job& j) const;

  // What each slot's cache rows hold in full prefill chunks (the prefix cache): a domain (-1:
  // nothing reusable) and the tokens of those positions.
  struct Held {
    int domain = -1;
    std::vector<int32_t> tokens;
  };

  Model& model_;
  const data::Tokenizer* tok_;
  const bool prefix_cache_;
  std::vector<Held> held_;  // [slots]
  BatchDecoder decoder_;
  const int queue_limit_;
  mutable std::mutex m_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::vector<std::optional<Active>> active_;  // [slots]
  bool stopping_ = false;
  EngineStats stats_;
  std::vector<float> scratch_;
  std::thread thread_;
};

}  // namespace sigma::serve
