// Tokenizer encode speed and compression per domain, single-threaded.
// Usage: bench_tokenizer TOKENIZER.json [CORPUS_DIR=../shared/data/corpus] [REPEATS=3]
// Each domain's texts are encoded REPEATS times in a fresh thread (so the per-thread piece cache
// starts cold each time); the median is reported, as wall-clock MB/s and as MB per second of
// the thread's CPU time (the per-core figure, which other jobs on the machine disturb less).
#include <fmt/core.h>

#include <time.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <thread>

#include "data/jsonl.h"
#include "data/tokenizer.h"

using namespace sigma::data;

int main(int argc, char** argv) {
  if (argc < 2) {
    fmt::print(stderr, "usage: {} TOKENIZER.json [CORPUS_DIR] [REPEATS]\n", argv[0]);
    return 2;
  }
  try {
    Tokenizer tok = Tokenizer::load(argv[1]);
    std::string corpus = argc > 2 ? argv[2] : "../shared/data/corpus";
    int repeats = argc > 3 ? std::max(1, std::atoi(argv[3])) : 3;
    std::map<std::string, std::vector<std::string>> by_domain;
    ReadStats stats;
    read_corpus(expand_corpus({corpus}), {}, stats,
                [&](Record& r) { by_domain[r.domain].push_back(std::move(r.text)); });
    fmt::print("tokenizer {} (vocab {}, hash {:016x}), corpus {}\n", argv[1], tok.vocab_size(),
               tok.hash(), corpus);
    fmt::print("{:<10} {:>9} {:>10} {:>11} {:>9} {:>12}\n", "domain", "MB", "tokens", "bytes/token",
               "MB/s", "MB/cpu-s");
    double all_bytes = 0, all_tokens = 0, all_s = 0, all_cpu = 0;
    auto cpu_now = [] {
      timespec ts;
      clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
      return ts.tv_sec + ts.tv_nsec * 1e-9;
    };
    for (auto& [domain, texts] : by_domain) {
      double bytes = 0;
      for (auto& t : texts) bytes += t.size();
      size_t tokens = 0;
      std::vector<double> times, cpus;
      for (int r = 0; r < repeats; ++r) {
        std::thread th([&] {  // new thread = empty cache
          auto t0 = std::chrono::steady_clock::now();
          double c0 = cpu_now();
          size_t n = 0;
          std::vector<uint32_t> ids;
          for (auto& t : texts) {
            ids.clear();
            tok.encode_append(t, ids);
            n += ids.size();
          }
          times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
          cpus.push_back(cpu_now() - c0);
          tokens = n;
        });
        th.join();
      }
      std::sort(times.begin(), times.end());
      std::sort(cpus.begin(), cpus.end());
      double s = times[times.size() / 2], cpu = cpus[cpus.size() / 2];
      fmt::print("{:<10} {:>9.2f} {:>10} {:>11.2f} {:>9.1f} {:>12.1f}\n", domain, bytes / 1e6, tokens,
                 bytes / tokens, bytes / 1e6 / s, bytes / 1e6 / cpu);
      all_cpu += cpu;
      all_bytes += bytes;
      all_tokens += tokens;
      all_s += s;
    }
    fmt::print("{:<10} {:>9.2f} {:>10} {:>11.2f} {:>9.1f} {:>12.1f}\n", "all", all_bytes / 1e6,
               static_cast<size_t>(all_tokens), all_bytes / all_tokens, all_bytes / 1e6 / all_s,
               all_bytes / 1e6 / all_cpu);
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_tokenizer: {}\n", e.what());
    return 1;
  }
  return 0;
}
