// Training-step benchmark of the dense model (issue 2): WARMUP + STEPS optimizer steps on
// random tokens, printing one JSON line with the median step time.
// Usage: bench_train [--d 512] [--layers 8] [--heads 8] [--T 512] [--batch 8] [--vocab 16384]
//                    [--steps 5] [--warmup 2] [--threads 2]
#include <fmt/format.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <string>

#include "core/rng.h"
#include "model/model.h"
#include "optim/adamw.h"
#include "optim/grad_norm.h"

using namespace sigma;

int main(int argc, char** argv) {
  int d = 512, layers = 8, heads = 8, T = 512, batch = 8, vocab = 16384, steps = 5, warmup = 2,
      threads = 2;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const int v = std::stoi(argv[i + 1]);
    if (k == "--d") d = v;
    else if (k == "--layers") layers = v;
    else if (k == "--heads") heads = v;
    else if (k == "--T") T = v;
    else if (k == "--batch") batch = v;
    else if (k == "--vocab") vocab = v;
    else if (k == "--steps") steps = v;
    else if (k == "--warmup") warmup = v;
    else if (k == "--threads") threads = v;
    else {
      fmt::print(stderr, "unknown option {}\n", k);
      return 2;
    }
  }
  omp_set_num_threads(threads);
  ModelConfig c;
  c.vocab = vocab;
  c.d_model = d;
  c.heads = heads;
  c.context = T;
  c.layers = layers;
  c.domains = {{"bench", "bench", 0}};
  Model m(c, 1);
  OptimConfig oc;
  AdamW opt(oc, m.params());
  Batch b;
  b.resize(batch, T);
  std::vector<float> loss(size_t(batch) * T), scale(loss.size(), 1.0f / float(loss.size()));
  std::vector<double> ms;
  double loss_first = 0, loss_last = 0, fwd_bwd_ms = 0;
  for (int s = 0; s < warmup + steps; ++s) {
    Rng r(7, uint64_t(s));
    for (auto& t : b.tokens) t = int32_t(r.below(uint32_t(vocab)));
    for (auto& t : b.targets) t = int32_t(r.below(uint32_t(vocab)));
    const auto t0 = std::chrono::steady_clock::now();
    m.params().zero_grad();
    m.forward(b, loss.data(), scale.data());
    m.backward(b);
    const auto t1 = std::chrono::steady_clock::now();
    const double norm = std::sqrt(grad_sq(m.params()));
    opt.step(m.params(), 1e-4f, norm > 1.0 ? float(1.0 / norm) : 1.0f);
    const auto t2 = std::chrono::steady_clock::now();
    double mean = 0;
    for (float l : loss) mean += l;
    mean /= double(loss.size());
    if (s == 0) loss_first = mean;
    loss_last = mean;
    if (s >= warmup) {
      ms.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
      fwd_bwd_ms += std::chrono::duration<double, std::milli>(t1 - t0).count();
    }
  }
  std::sort(ms.begin(), ms.end());
  const double median = ms[ms.size() / 2];
  const double tps = double(batch) * T * 1000.0 / median;
  const double fpt = m.train_flops_per_token();
  fmt::print("{{\"impl\":\"sigma\",\"tokens_per_s\":{:.1f},\"step_ms\":{:.1f},\"fwd_bwd_ms_mean\":{:.1f},"
             "\"params\":{},\"flops_per_token\":{:.0f},\"achieved_gflops\":{:.1f},"
             "\"loss_first\":{:.4f},\"loss_last\":{:.4f},\"threads\":{}}}\n",
             tps, median, fwd_bwd_ms / steps, m.params().numel(), fpt, tps * fpt / 1e9, loss_first,
             loss_last, threads);
  return 0;
}
