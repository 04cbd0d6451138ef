#include "serve/engine.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <numeric>

namespace sigma::serve {

void Histogram::add(double seconds) {
  size_t b = 0;
  while (b < kBounds.size() && seconds > kBounds[b]) ++b;
  counts[b] += 1;
  sum += seconds;
  count += 1;
}

std::string Histogram::prometheus(const std::string& name) const {
  std::string out;
  int64_t cumulative = 0;
  for (size_t b = 0; b < counts.size(); ++b) {
    cumulative += counts[b];
    const std::string le = b < kBounds.size() ? fmt::format("{}", kBounds[b]) : "+Inf";
    out += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, le, cumulative);
  }
  return out + fmt::format("{}_sum {:.6f}\n{}_count {}\n", name, sum, name, count);
}

Channel::Channel(int choices)
    : prompt_logprobs(static_cast<size_t>(choices)),
      cancelled(new std::atomic<bool>[static_cast<size_t>(choices)]), n(choices) {
  for (int i = 0; i < n; ++i) cancelled[i] = false;
}

void Channel::cancel_all() {
  for (int i = 0; i < n; ++i) cancelled[i] = true;
}

void Channel::push(TokenEvent e) {
  {
    std::lock_guard<std::mutex> lock(m);
    events.push_back(std::move(e));
  }
  cv.notify_all();
}

std::optional<TokenEvent> Channel::pop(int ms) {
  std::unique_lock<std::mutex> lock(m);
  if (!cv.wait_for(lock, std::chrono::milliseconds(ms), [&] { return !events.empty(); }))
    return std::nullopt;
  TokenEvent e = std::move(events.front());
  events.pop_front();
  return e;
}

Engine::Engine(Model& model, int slots, int queue_limit, const data::Tokenizer* tok, bool prefix_cache)
    : model_(model), tok_(tok), prefix_cache_(prefix_cache), held_(static_cast<size_t>(slots)),
      decoder_(model, slots), queue_limit_(queue_limit),
      active_(static_cast<size_t>(slots)), scratch_(static_cast<size_t>(model.config().vocab)) {
  thread_ = std::thread([this] { loop(); });
}

Engine::~Engine() { shutdown(); }

bool Engine::submit(std::vector<Job> jobs) {
  {
    std::lock_guard<std::mutex> lock(m_);
    // The queue limit counts choices that will wait for a slot: those that free slots will
    // take at the next step boundary are not waiting (an idle server takes slots + queue).
    const size_t free_slots = active_.size() - size_t(stats_.busy_slots);
    if (stopping_ || queue_.size() + jobs.size() > size_t(queue_limit_) + free_slots) return false;
    for (Job& j : jobs) queue_.push_back(std::move(j));
    stats_.queued = int(queue_.size());
  }
  cv_.notify_all();
  return true;
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> lock(m_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

EngineStats Engine::stats() const {
  std::lock_guard<std::mutex> lock(m_);
  return stats_;
}

// A fault inside the model (none is expected: requests are checked before they queue) ends the
// choices it touched with finish_reason "error" instead of taking the server down.
void Engine::loop() {
  std::vector<int> fresh;
  for (;;) {
    if (!admit_waiting(fresh)) return;
    for (int slot : fresh) {
      try {
        start(slot);
      } catch (const std::exception& e) {
        fail(slot, e.what());
      }
    }
    try {
      step_all();
    } catch (const std::exception& e) {
      for (size_t s = 0; s < active_.size(); ++s)
        if (active_[s]) fail(int(s), e.what());
    }
  }
}

void Engine::fail(int slot, const std::string& what) {
  if (!active_[size_t(slot)]) return;
  active_[size_t(slot)]->job.out->error = what;
  finish(slot, "error");
}

// Moves queued jobs into free slots (waiting while there is nothing to do); false once stopping
// with nothing left.
bool Engine::admit_waiting(std::vector<int>& fresh) {
  fresh.clear();
  std::unique_lock<std::mutex> lock(m_);
  auto busy = [&] {
    return int(std::count_if(active_.begin(), active_.end(), [](auto& a) { return a.has_value(); }));
  };
  cv_.wait(lock, [&] { return !queue_.empty() || busy() > 0 || stopping_; });
  if (stopping_ && queue_.empty() && busy() == 0) return false;
  for (size_t s = 0; s < active_.size() && !queue_.empty(); ++s) {
    if (active_[s]) continue;
    active_[s] = Active{std::move(queue_.front()), {}, 0, {}, {}};
    queue_.pop_front();
    fresh.push_back(int(s));
  }
  stats_.queued = int(queue_.size());
  stats_.busy_slots = busy();
  return true;
}

// Prefill: the prompt in one pass (scoring it when asked), then the first new token. A request
// that only scores its prompt runs all but its last token (so it may be context + 1 long).
void Engine::start(int slot) {
  Active& a = *active_[size_t(slot)];
  Job& j = a.job;
  a.seq = j.prompt;
  if (j.out->cancelled[j.index]) return finish(slot, "stop");
  const bool generate = j.s.max_new_tokens > 0;
  std::vector<float> scored(j.prompt_logprobs ? j.prompt.size() - 1 : 0);
  const float* logits = nullptr;
  int reused = 0;
  Held& held = held_[size_t(slot)];
  if (generate) {
    const auto [n, from] = j.prompt_logprobs ? std::pair<int, int>{0, slot} : reusable(j);
    held = Held{};  // the slot's rows are rewritten from n on
    decoder_.copy_prefix(from, slot, n);
    logits = decoder_.prefill(slot, j.domain, j.prompt, j.prompt_logprobs ? scored.data() : nullptr, n);
    reused = n;
    const size_t full = j.prompt.size() / BatchDecoder::kPrefillChunk * BatchDecoder::kPrefillChunk;
    if (prefix_cache_) held = Held{j.domain, {j.prompt.begin(), j.prompt.begin() + int64_t(full)}};
  } else if (j.prompt_logprobs && j.prompt.size() > 1) {
    held = Held{};  // scored in one pass, not in chunks: nothing to reuse
    decoder_.score(slot, j.domain, j.prompt, scored.data());
  }
  {
    std::lock_guard<std::mutex> lock(m_);
    stats_.prompt_tokens += int64_t(j.prompt.size());
    stats_.prefix_tokens_reused += reused;
  }
  if (j.prompt_logprobs) {
    std::lock_guard<std::mutex> lock(j.out->m);
    j.out->prompt_logprobs[size_t(j.index)] = std::move(scored);
  }
  if (!generate) return finish(slot, "length");
  advance(slot, logits);
}

std::pair<int, int> Engine::reusable(const Job& j) const {
  if (!prefix_cache_) return {0, 0};
  int best = 0, from = 0;
  // At least the prompt's last token is computed: its logits start the generation.
  const size_t limit = j.prompt.size() - 1;
  for (size_t s = 0; s < held_.size(); ++s) {
    const Held& h = held_[s];
    if (h.domain != j.domain) continue;
    const size_t n = std::min(h.tokens.size(), limit);
    const size_t common = size_t(std::mismatch(h.tokens.begin(), h.tokens.begin() + int64_t(n), j.prompt.begin()).first -
                                 h.tokens.begin());
    const int usable = int(common / BatchDecoder::kPrefillChunk * BatchDecoder::kPrefillChunk);
    if (usable > best) best = usable, from = int(s);
  }
  return {best, from};
}

void Engine::step_all() {
  std::vector<int> slots, domains;
  std::vector<int32_t> tokens;
  for (size_t s = 0; s < active_.size(); ++s) {
    if (!active_[s]) continue;
    if (active_[s]->job.out->cancelled[active_[s]->job.index]) {
      finish(int(s), "stop");
      continue;
    }
    slots.push_back(int(s));
    domains.push_back(active_[s]->job.domain);
    tokens.push_back(active_[s]->seq.back());
  }
  if (slots.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  decoder_.step(slots, domains, tokens);
  for (size_t i = 0; i < slots.size(); ++i) advance(slots[i], decoder_.logits(int(i)));
  const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::lock_guard<std::mutex> lock(m_);
  stats_.decode_steps += 1;
  stats_.decode_tokens += int64_t(slots.size());
  stats_.decode_seconds += dt;
}

void Engine::mask_json(const Active& a, float* logits) const {
  const int64_t V = model_.config().vocab;
  for (int64_t id = 0; id < V; ++id) {
    if (tok_->is_control(uint32_t(id))) {
      logits[id] = -1e30f;
      continue;
    }
    JsonPrefix next = a.json;
    if (!next.push(tok_->token_bytes(uint32_t(id)))) logits[id] = -1e30f;
  }
}

void Engine::advance(int slot, const float* logits) {
  Active& a = *active_[size_t(slot)];
  const Job& j = a.job;
  const int64_t V = model_.config().vocab;
  TokenEvent e;
  e.index = j.index;
  std::copy(logits, logits + V, scratch_.begin());  // sample_next modifies its logits
  for (const auto& [id, bias] : j.logit_bias) scratch_[size_t(id)] += bias;
  if (j.json_object && tok_) mask_json(a, scratch_.data());
  e.token = sample_next(scratch_.data(), V, a.seq, j.s, uint64_t(a.generated));
  if (j.top_logprobs >= 0) {
    e.logprob = token_logprob(logits, V, e.token);
    std::vector<int32_t> ids(static_cast<size_t>(V));
    std::iota(ids.begin(), ids.end(), 0);
    const size_t k = std::min<size_t>(size_t(j.top_logprobs), ids.size());
    std::partial_sort(ids.begin(), ids.begin() + int64_t(k), ids.end(),
                      [&](int32_t x, int32_t y) { return logits[x] > logits[y] || (logits[x] == logits[y] && x < y); });
    for (size_t i = 0; i < k; ++i) e.top.emplace_back(ids[i], token_logprob(logits, V, ids[i]));
  }
  bool json_done = false;
  if (j.json_object && tok_) {
    a.json.push(tok_->token_bytes(uint32_t(e.token)));
    json_done = a.json.complete();
  }
  a.seq.push_back(e.token);
  a.generated += 1;
  const auto now = std::chrono::steady_clock::now();
  {
    std::lock_guard<std::mutex> lock(m_);
    stats_.generated_tokens += 1;
    if (a.generated == 1)
      stats_.time_to_first_token.add(std::chrono::duration<double>(now - j.submitted).count());
    else
      stats_.inter_token.add(std::chrono::duration<double>(now - a.last_token).count());
  }
  a.last_token = now;
  j.out->push(std::move(e));
  const bool stop = json_done || std::find(j.stop_tokens.begin(), j.stop_tokens.end(), a.seq.back()) !=
                                     j.stop_tokens.end();
  // The next step feeds the new token at position seq.size() - 1, which must be in the context.
  if (stop) finish(slot, "stop");
  else if (a.generated >= j.s.max_new_tokens || int(a.seq.size()) > model_.config().context)
    finish(slot, "length");
}

void Engine::finish(int slot, const char* reason) {
  Active& a = *active_[size_t(slot)];
  TokenEvent e;
  e.index = a.job.index;
  e.finish_reason = reason;
  a.job.out->push(std::move(e));
  active_[size_t(slot)].reset();
  std::lock_guard<std::mutex> lock(m_);
  stats_.busy_slots -= 1;
}

}  // namespace sigma::serve
