// Prefix cache benchmark (issue 27; docs/benchmarks.md "Serving: prefix cache"): time to first
// token of a request whose 400-token prompt prefix an earlier request already prefilled, with
// the engine's prefix cache on and off, on a d=512, 8-block dense model (random weights: speed
// does not depend on them), and a check that the tokens and log-probabilities are the same bits.
//
//   build/bench_prefix_cache [ROUNDS=5]
// Each round: a fresh 400-token prefix; request A = prefix + 16 tokens (cold), then request B =
// prefix + 16 other tokens (warm), one token each. Medians over the rounds.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "serve/engine.h"

using namespace sigma;
using Clock = std::chrono::steady_clock;

namespace {

struct Result {
  double ttft;
  int32_t token;
  double logprob;
};

Result ask(serve::Engine& engine, const std::vector<int32_t>& prompt) {
  auto ch = std::make_shared<serve::Channel>(1);
  serve::Job j;
  j.prompt = prompt;
  j.s.max_new_tokens = 1;
  j.top_logprobs = 0;
  j.out = ch;
  const auto t0 = Clock::now();
  if (!engine.submit({j})) std::abort();
  auto e = ch->pop(600000);
  const double ttft = std::chrono::duration<double>(Clock::now() - t0).count();
  while (auto f = ch->pop(600000))
    if (!f->finish_reason.empty()) break;
  return {ttft, e->token, e->logprob};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 5;
  ModelConfig c;
  c.vocab = 8192;
  c.d_model = 512;
  c.heads = 8;
  c.context = 512;
  c.layers = 8;
  c.slots = 1;
  c.domains = {{"a", "a", 0}};
  c.validate();
  Model model(c, 1);
  std::vector<double> cold[2], warm[2];
  std::vector<Result> outputs[2];
  for (int cache = 1; cache >= 0; --cache) {
    serve::Engine engine(model, 2, 8, nullptr, cache == 1);
    for (int r = 0; r < rounds; ++r) {
      std::vector<int32_t> prefix;
      for (int i = 0; i < 400; ++i) prefix.push_back(int32_t((i * 7919 + r * 104729) % c.vocab));
      std::vector<int32_t> a = prefix, b = prefix;
      for (int i = 0; i < 16; ++i) a.push_back(int32_t((i * 31 + r) % c.vocab)), b.push_back(int32_t((i * 37 + 5 + r) % c.vocab));
      const Result ra = ask(engine, a), rb = ask(engine, b);
      cold[cache].push_back(ra.ttft);
      warm[cache].push_back(rb.ttft);
      outputs[cache].push_back(ra);
      outputs[cache].push_back(rb);
    }
  }
  bool same = true;
  for (size_t i = 0; i < outputs[0].size(); ++i)
    same = same && outputs[0][i].token == outputs[1][i].token &&
           std::memcmp(&outputs[0][i].logprob, &outputs[1][i].logprob, sizeof(double)) == 0;
  fmt::print("prefix cache, d=512 x 8 blocks, 400-token shared prefix + 16 tokens, medians of {} rounds\n", rounds);
  for (int cache = 1; cache >= 0; --cache)
    fmt::print("  cache {:3}: first request TTFT {:7.2f} ms, second {:7.2f} ms ({:.2f}x lower)\n", cache ? "on" : "off",
               1e3 * median(cold[cache]), 1e3 * median(warm[cache]), median(cold[cache]) / median(warm[cache]));
  fmt::print("  second request with the cache vs without: {:.2f}x lower TTFT\n", median(warm[0]) / median(warm[1]));
  fmt::print("  tokens and log-probabilities with and without the cache: {}\n", same ? "same bits" : "DIFFERENT");
  return same ? 0 : 1;
}
