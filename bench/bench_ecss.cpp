// ECSS against vanilla offload (issue 5): training-step time as the experts per group grow at
// fixed active parameters (one expert per token and RRE block), and a file-backed store larger
// than RAM.
//
// The model has G domains, each with its own expert group of K experts; each step's batch is
// one domain's (round robin), as when domain data is sharded by step, so a step activates at
// most K experts per RRE block (those its token ids route to) of the G*K. Both modes use the
// same ExpertStore and the same trainer pieces (src/ecss/ecss_experts.h): "ecss" gathers
// and updates the active experts, "vanilla" every expert every step.
//
// Per step it times: forward+backward, the expert gather (store -> compute buffers, grads
// zeroed), waiting for the background prefetch, the gradient norm, the shared AdamW, the
// experts' Adam. Prints the median of each over the measured steps, one line per (K, mode),
// and a JSON line per run for docs.
//
// Usage: bench_ecss [--d 128] [--layers 4] [--rre 2] [--T 256] [--batch 16] [--vocab 4096]
//                   [--groups 8] [--experts 4,8,16,32,64] [--modes ecss,vanilla]
//                   [--steps 8] [--warmup 2] [--threads 2] [--store PATH] [--expert-memory BYTES]
// With --store the store is that file (created; removed at the end) instead of RAM.
#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "core/rng.h"
#include "model/model.h"
#include "optim/adamw.h"
#include "optim/grad_norm.h"
#include "ecss/ecss_experts.h"

using namespace sigma;

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string x; std::getline(in, x, ',');) out.push_back(x);
  return out;
}

// kB fields of /proc/self/status (VmRSS, RssAnon, RssFile, VmHWM).
int64_t status_kb(const char* key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.rfind(key, 0) == 0) return std::stoll(line.substr(std::strlen(key) + 1));
  return -1;
}

// One domain's batch: uniform random token ids (every id as likely: the routing tables then
// activate as many experts as the batch has distinct ids reach).
void fill_batch(Batch& b, int B, int T, int V, int domain, uint64_t step) {
  b.resize(B, T);
  for (int r = 0; r < B; ++r) {
    b.domain[size_t(r)] = domain;
    for (int t = 0; t < T; ++t) {
      const size_t i = size_t(r) * T + t;
      b.tokens[i] = int32_t(rng_u64(7, step, i) % uint64_t(V));
      b.targets[i] = int32_t(rng_u64(8, step, i) % uint64_t(V));
      b.mask[i] = 1.0f;
    }
  }
}

struct Times {
  std::vector<double> step, fwd_bwd, gather, wait, norm, adam_shared, adam_experts;
  std::vector<double> active;
};

}  // namespace

int main(int argc, char** argv) {
  int d = 128, layers = 4, rre = 2, T = 256, batch = 16, vocab = 4096, groups = 8, steps = 8,
      warmup = 2, threads = 2;
  std::string experts_list = "4,8,16,32,64", modes_list = "ecss,vanilla", store;
  int64_t expert_memory = int64_t(1) << 40;  // bytes of compute buffers; default: no limit
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--d") d = std::stoi(v);
    else if (k == "--layers") layers = std::stoi(v);
    else if (k == "--rre") rre = std::stoi(v);
    else if (k == "--T") T = std::stoi(v);
    else if (k == "--batch") batch = std::stoi(v);
    else if (k == "--vocab") vocab = std::stoi(v);
    else if (k == "--groups") groups = std::stoi(v);
    else if (k == "--experts") experts_list = v;
    else if (k == "--modes") modes_list = v;
    else if (k == "--steps") steps = std::stoi(v);
    else if (k == "--warmup") warmup = std::stoi(v);
    else if (k == "--threads") threads = std::stoi(v);
    else if (k == "--store") store = v;
    else if (k == "--expert-memory") expert_memory = std::stoll(v);
    else {
      fmt::print(stderr, "unknown option {}\n", k);
      return 2;
    }
  }
  omp_set_num_threads(threads);
  fmt::print("# bench_ecss: d={} layers={} rre={} T={} batch={} vocab={} groups={} steps={} "
             "(+{} warm-up) threads={} store={}\n",
             d, layers, rre, T, batch, vocab, groups, steps, warmup, threads,
             store.empty() ? "RAM" : store);
  fmt::print("{:>4} {:>8} {:>9} {:>10} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9}\n", "K",
             "mode", "store_GB", "active/stp", "step_s", "fwd_bwd", "gather", "wait", "norm",
             "adam_sh", "adam_ex", "tok/s");
  for (const std::string& ks : split(experts_list)) {
    const int K = std::stoi(ks);
    for (const std::string& mode_name : split(modes_list)) {
      ModelConfig c;
      c.vocab = vocab;
      c.d_model = d;
      c.heads = 4;
      c.context = T;
      c.layers = layers;
      c.rre_layers = rre;
      for (int g = 0; g < groups; ++g) {
        c.groups.push_back({fmt::format("g{}", g), K});
        c.domains.push_back({fmt::format("d{}", g), fmt::format("g{}", g), 0});
      }
      const ExpertMode mode = resolve_expert_mode(mode_name, c);
      OptimConfig oc;
      oc.warmup = 0;
      Model model(c, 1, nullptr, /*external_experts=*/true);
      AdamW opt(oc, model.params());
      if (!store.empty()) std::filesystem::remove(store);
      const auto t_init = Clock::now();
      EcssExperts experts(model, mode, oc, store, /*resuming=*/false, expert_memory);
      const double init_s = since(t_init);
      const double store_gb = double(experts.store().data_bytes()) / 1e9;

      std::vector<float> token_loss(size_t(batch) * T), scale(size_t(batch) * T, 1.0f / (batch * T));
      Batch cur, next;
      fill_batch(cur, batch, T, vocab, 0, 0);
      Times tm;
      const auto t_run = Clock::now();
      for (int s = 0; s < warmup + steps; ++s) {
        const auto t0 = Clock::now();
        auto t = Clock::now();
        const double wait0 = experts.stats().wait_s;
        experts.begin_step({&cur, 1});
        const double gather = since(t) - (experts.stats().wait_s - wait0);
        fill_batch(next, batch, T, vocab, (s + 1) % groups, uint64_t(s + 1));
        experts.prefetch({&next, 1});
        t = Clock::now();
        model.params().zero_grad();
        model.forward(cur, token_loss.data(), scale.data());
        model.backward(cur);
        const double fb = since(t);
        t = Clock::now();
        std::vector<double> parts = grad_sq_parts(model.params());
        experts.append_grad_sq_parts(parts);
        const double norm = std::sqrt(fold(parts));
        const double tn = since(t);
        const float clip = norm > 1.0 ? float(1.0 / norm) : 1.0f;
        t = Clock::now();
        opt.step(model.params(), 1e-4f, clip);
        const double ta = since(t);
        const double wait1 = experts.stats().wait_s;
        t = Clock::now();
        experts.update(1e-4f, clip);
        const double te = since(t) - (experts.stats().wait_s - wait1);
        const double total = since(t0);
        if (s >= warmup) {
          tm.step.push_back(total);
          tm.fwd_bwd.push_back(fb);
          tm.gather.push_back(gather);
          tm.wait.push_back(experts.stats().wait_s - wait0);
          tm.norm.push_back(tn);
          tm.adam_shared.push_back(ta);
          tm.adam_experts.push_back(te);
          tm.active.push_back(double(experts.active()));
        }
        if (!store.empty())
          fmt::print(stderr, "step {:>3}: {:.2f} s (gather {:.2f}, wait {:.2f}, adam {:.2f}), RSS {:.1f} GiB "
                     "(anon {:.1f}, file {:.1f})\n", s, total, gather,
                     experts.stats().wait_s - wait0, te, status_kb("VmRSS:") / 1048576.0,
                     status_kb("RssAnon:") / 1048576.0, status_kb("RssFile:") / 1048576.0);
        std::swap(cur, next);
      }
      const double run_s = since(t_run);
      const double step_s = median(tm.step), tps = double(batch) * T / step_s;
      fmt::print("{:>4} {:>8} {:>9.2f} {:>10.0f} {:>8.4f} {:>8.4f} {:>8.4f} {:>8.4f} {:>8.4f} {:>8.4f} "
                 "{:>8.4f} {:>9.0f}\n",
                 K, mode_name, store_gb, median(tm.active), step_s, median(tm.fwd_bwd),
                 median(tm.gather), median(tm.wait), median(tm.norm), median(tm.adam_shared),
                 median(tm.adam_experts), tps);
      double store_time = 0, total_time = 0;
      for (size_t i = 0; i < tm.step.size(); ++i) {
        store_time += tm.gather[i] + tm.wait[i];
        total_time += tm.step[i];
      }
      fmt::print("{{\"K\": {}, \"mode\": \"{}\", \"groups\": {}, \"store_bytes\": {}, \"experts\": {}, "
                 "\"init_s\": {:.2f}, \"run_s\": {:.2f}, \"step_s\": {:.5f}, \"tokens_per_s\": {:.1f}, "
                 "\"store_wait_fraction\": {:.4f}, \"rss_gib\": {:.2f}, \"rss_anon_gib\": {:.2f}, "
                 "\"rss_file_gib\": {:.2f}, \"hwm_gib\": {:.2f}}}\n",
                 K, mode_name, groups, experts.store().data_bytes(), experts.store().num_experts(),
                 init_s, run_s, step_s, tps, total_time > 0 ? store_time / total_time : 0.0,
                 status_kb("VmRSS:") / 1048576.0, status_kb("RssAnon:") / 1048576.0,
                 status_kb("RssFile:") / 1048576.0, status_kb("VmHWM:") / 1048576.0);
      std::fflush(stdout);
    }
  }
  if (!store.empty()) std::filesystem::remove(store);
  return 0;
}
