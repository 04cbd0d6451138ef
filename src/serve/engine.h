// The serving engine (DESIGN §10): one model, `slots` sequences decoded together (continuous
// batching: queued requests are admitted between two decode steps), a bounded queue, and the
// counters /metrics reports. HTTP threads submit jobs and read their events from a Channel; the
// engine thread alone touches the model.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "infer/batch_decoder.h"
#include "infer/generate.h"

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
  std::shared_ptr<Channel> out;
};

struct EngineStats {
  int64_t prompt_tokens = 0, generated_tokens = 0, decode_steps = 0, decode_tokens = 0;
  double decode_seconds = 0;  // time inside decode steps (not prefill)
  int busy_slots = 0, queued = 0;
};

class Engine {
 public:
  Engine(Model& model, int slots, int queue_limit);
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
  };
  void loop();
  bool admit_waiting(std::vector<int>& fresh);
  void start(int slot);
  void step_all();
  // Samples, reports and ends (when due) the sequence in `slot` from its next-token logits.
  void advance(int slot, const float* logits);
  void finish(int slot, const char* reason);
  void fail(int slot, const std::string& what);

  Model& model_;
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
