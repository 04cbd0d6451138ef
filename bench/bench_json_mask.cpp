// bench_json_mask: what `response_format: {"type": "json_object"}` costs per generated token
// (docs/serving.md): the engine's mask (serve/engine.cpp, Engine::mask_json) tests every
// vocabulary entry's bytes against the JSON-object recogniser (serve/json_prefix.h) before each
// token is drawn. This times that loop alone, from a few recogniser states a completion passes
// through, with a real tokenizer's vocabulary. Prints one JSON line per state and the median.
//
//   bench_json_mask TOKENIZER.json [--reps 200]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "serve/json_prefix.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: bench_json_mask TOKENIZER.json [--reps 200]\n");
    return 2;
  }
  int reps = 200;
  if (argc >= 4 && std::string(argv[2]) == "--reps") reps = std::atoi(argv[3]);
  const auto tok = sigma::data::Tokenizer::load(argv[1]);
  const uint32_t V = tok.vocab_size();
  std::vector<float> logits(V, 0.0f);
  // States: before '{', inside a key, after a colon, inside a string value, after a number.
  const std::vector<std::string> prefixes = {"", "{\"na", "{\"name\": ", "{\"name\": \"Ada Lov",
                                             "{\"a\": [1, 2.5"};
  std::vector<double> all;
  for (const std::string& p : prefixes) {
    sigma::serve::JsonPrefix state;
    if (!state.push(p)) return 1;
    std::vector<double> us;
    int allowed = 0;
    for (int r = 0; r < reps; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      allowed = 0;
      for (uint32_t id = 0; id < V; ++id) {  // Engine::mask_json's loop
        if (tok.is_control(id)) {
          logits[id] = -1e30f;
          continue;
        }
        sigma::serve::JsonPrefix next = state;
        if (!next.push(tok.token_bytes(id))) logits[id] = -1e30f;
        else ++allowed;
      }
      us.push_back(std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(us.begin(), us.end());
    all.push_back(us[us.size() / 2]);
    std::string quoted;  // the prefix as a JSON string
    for (char c : p) quoted += c == '"' ? std::string("\\\"") : std::string(1, c);
    std::printf("{\"prefix\": \"%s\", \"vocab\": %u, \"allowed\": %d, \"us_per_token\": %.1f}\n",
                quoted.c_str(), V, allowed, us[us.size() / 2]);
  }
  std::sort(all.begin(), all.end());
  std::printf("{\"median_us_per_token\": %.1f}\n", all[all.size() / 2]);
  return 0;
}
