// Forward+backward step time of the expert-block variants at one shape (issue 4): dense, RRE
// with K experts per group, and the learned top-1 / top-2 gates, on random tokens of 6 domains
// in 4 groups. Interleaves the variants round by round (so machine drift hits all alike) and
// prints the fastest and the median step per variant as tokens/s (interference only adds
// time, so the fastest step is the machine's capability; the median what a run sees).
// Usage: bench_rre_step [--d 128] [--layers 4] [--rre 2] [--T 128] [--batch 8]
//                       [--vocab 16384] [--rounds 15] [--threads 2]
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <string>

#include "core/rng.h"
#include "model/model.h"

using namespace sigma;

int main(int argc, char** argv) {
  int d = 128, layers = 4, rre = 2, T = 128, batch = 8, vocab = 16384, rounds = 15, threads = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::stoi(argv[i + 1]);
    if (k == "--d") d = v;
    else if (k == "--layers") layers = v;
    else if (k == "--rre") rre = v;
    else if (k == "--T") T = v;
    else if (k == "--batch") batch = v;
    else if (k == "--vocab") vocab = v;
    else if (k == "--rounds") rounds = v;
    else if (k == "--threads") threads = v;
    else {
      fmt::print(stderr, "unknown option {}\n", k);
      return 2;
    }
  }
  omp_set_num_threads(threads);
  struct Variant {
    std::string name, router;
    int experts, rre_layers;
  };
  const std::vector<Variant> variants = {{"dense", "rre", 1, 0},  {"rre4", "rre", 4, rre},
                                         {"rre16", "rre", 16, rre}, {"top1", "top1", 4, rre},
                                         {"top2", "top2", 4, rre}};
  const std::vector<std::pair<std::string, std::string>> domains = {
      {"english", "en"}, {"chinese", "zh"}, {"poetry", "zh"},
      {"bilingual", "enzh"}, {"python", "code"}, {"java", "code"}};
  std::vector<std::unique_ptr<Model>> models;
  for (const Variant& v : variants) {
    ModelConfig c;
    c.vocab = vocab;
    c.d_model = d;
    c.heads = 4;
    c.context = T;
    c.layers = layers;
    c.rre_layers = v.rre_layers;
    c.router = v.router;
    c.capacity_factor = 1.25f;
    for (const char* g : {"en", "zh", "enzh", "code"}) c.groups.push_back({g, v.experts});
    for (const auto& [n, g] : domains) c.domains.push_back({n, g, 0});
    models.push_back(std::make_unique<Model>(c, 1));
  }
  Batch b;
  b.resize(batch, T);
  Rng r(7, 1);
  for (auto& t : b.tokens) t = int32_t(r.below(uint32_t(vocab)));
  for (auto& t : b.targets) t = int32_t(r.below(uint32_t(vocab)));
  for (int i = 0; i < batch; ++i) b.domain[size_t(i)] = i % int(domains.size());
  std::vector<float> loss(size_t(batch) * T), scale(loss.size(), 1.0f / float(loss.size()));
  std::vector<std::vector<double>> ms(variants.size());
  for (int round = -1; round < rounds; ++round)  // round -1 warms up
    for (size_t v = 0; v < variants.size(); ++v) {
      const auto t0 = std::chrono::steady_clock::now();
      models[v]->params().zero_grad();
      models[v]->forward(b, loss.data(), scale.data());
      models[v]->backward(b);
      const double t = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (round >= 0) ms[v].push_back(t);
    }
  fmt::print("fwd+bwd, d={} layers={} (expert blocks {}) T={} batch={} V={} threads={}\n", d,
             layers, rre, T, batch, vocab, threads);
  fmt::print("{:<8} {:>12} {:>12} {:>14} {:>14}\n", "variant", "best ms", "median ms",
             "best tok/s", "median tok/s");
  const double tokens = double(batch) * T;
  for (size_t v = 0; v < variants.size(); ++v) {
    std::sort(ms[v].begin(), ms[v].end());
    const double best = ms[v].front(), med = ms[v][ms[v].size() / 2];
    fmt::print("{:<8} {:>12.1f} {:>12.1f} {:>14.0f} {:>14.0f}\n", variants[v].name, best, med,
               tokens * 1000 / best, tokens * 1000 / med);
  }
  return 0;
}
