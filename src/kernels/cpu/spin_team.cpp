#include "kernels/cpu/spin_team.h"

#include <omp.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <thread>

#include <unistd.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace sigma::cpu {

namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

thread_local bool t_helper = false;  // a job's items run their own nested jobs alone
std::atomic<int64_t> g_helper_items{0};

const int64_t g_prefetch_budget = [] {
  const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return std::min<int64_t>(int64_t(256) << 10, l2 > 0 ? int64_t(l2) / 4 : int64_t(128) << 10);
}();

// What is left to prefetch of a Stream: [p, end), whole 64-byte lines.
struct PrefetchCursor {
  const char* p = nullptr;
  const char* end = nullptr;
  void set(const Stream& s) {
    const auto a = reinterpret_cast<uintptr_t>(s.p);
    p = reinterpret_cast<const char*>(a / 64 * 64);
    end = s.p ? static_cast<const char*>(s.p) + std::min(s.bytes, g_prefetch_budget) : p;
  }
  // Prefetches a few lines into L2; false when nothing was left.
  bool step() {
    if (p >= end) return false;
    for (int k = 0; k < 8 && p < end; ++k, p += 64) {
#if defined(__x86_64__)
      _mm_prefetch(p, _MM_HINT_T1);
#else
      __builtin_prefetch(p, 0, 2);
#endif
    }
    return true;
  }
};

// Spins until done() or the budget has passed (forever for a zero budget); between checks a
// few lines of `ahead` prefetched, or a pause, and every 64 a sched_yield, so that a thread that
// wants this core gets it.
template <class Done>
bool spin_until(Done&& done, std::chrono::microseconds budget, PrefetchCursor* ahead = nullptr) {
  const auto start = std::chrono::steady_clock::now();
  for (uint32_t i = 1;; ++i) {
    if (done()) return true;
    if (!ahead || !ahead->step()) cpu_relax();
    if (i % 64 == 0) {
      if (budget.count() > 0 && std::chrono::steady_clock::now() - start > budget) return false;
      sched_yield();
    }
  }
}

struct Job {
  void (*fn)(void*, int64_t);
  void* ctx;
  int64_t items;
  int64_t first;  // the items of the first phase (for_each_item_phased); items if one phase
  NextJob ahead;  // the next job's streams (spin_team.h)
  std::atomic<int64_t> next{0}, done{0};

  void claim_items() {
    int64_t ran = 0;
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items; ++ran) {
      if (i >= first)  // every first-phase item is claimed: wait for those still running
        spin_until([&] { return done.load(std::memory_order_acquire) >= first; },
                   std::chrono::microseconds(0));
      fn(ctx, i);
      done.fetch_add(1, std::memory_order_release);
    }
    if (t_helper && ran > 0) g_helper_items.fetch_add(ran, std::memory_order_relaxed);
  }
};

class Team {
 public:
  explicit Team(int helpers) {
    for (int t = 0; t < helpers; ++t) std::thread([this] { serve(); }).detach();
  }

  // False (nothing run) when another thread's job is running.
  bool run(void (*fn)(void*, int64_t), void* ctx, int64_t items, int64_t first,
           const NextJob& next) {
    if (busy_.exchange(true, std::memory_order_acquire)) return false;
    Job job{fn, ctx, items, first, next};
    job_.store(&job);
    generation_.fetch_add(1);  // seq_cst, like every access below: ordered before sleeping_
    if (sleeping_.load() > 0) generation_.notify_all();
    job.claim_items();
    PrefetchCursor ahead;  // while the helpers finish, the start of the caller's next item
    ahead.set(next.caller);
    spin_until([&] { return job.done.load(std::memory_order_acquire) == items; },
               std::chrono::microseconds(0), &ahead);
    // A helper that took &job before this store has counted itself in active_ first.
    job_.store(nullptr);
    spin_until([&] { return active_.load() == 0; }, std::chrono::microseconds(0));
    busy_.store(false, std::memory_order_release);
    return true;
  }

 private:
  [[noreturn]] void serve() {
    t_helper = true;
    uint64_t seen = 0;
    PrefetchCursor ahead;  // the start of this helper's item of the next job, while it spins
    for (;;) {
      uint64_t now = 0;
      auto moved = [&] { return (now = generation_.load()) != seen; };
      if (!spin_until(moved, kSpinBudget, &ahead)) {
        sleeping_.fetch_add(1);  // a run() that reads 0 here has moved generation_ already
        while (!moved()) generation_.wait(seen);
        sleeping_.fetch_sub(1);
      }
      seen = now;
      active_.fetch_add(1);
      if (Job* job = job_.load()) {
        job->claim_items();
        if (job->ahead.helper.p) ahead.set(job->ahead.helper);  // the job ends with active_
      }
      active_.fetch_sub(1);
    }
  }

  std::atomic<uint64_t> generation_{0};
  std::atomic<Job*> job_{nullptr};
  std::atomic<int> sleeping_{0}, active_{0};
  std::atomic<bool> busy_{false};
};

// Helpers for OpenMP's thread count at first use. Never destroyed: a job may still run on
// another thread while the process exits.
Team* team() {
  static Team* t = new Team(std::max(0, omp_get_max_threads() - 1));
  return t;
}

}  // namespace

int team_threads() { return omp_get_max_threads(); }

int64_t prefetch_budget() { return g_prefetch_budget; }

int64_t helper_items() { return g_helper_items.load(std::memory_order_relaxed); }

void detail::for_each_item(int64_t first, int64_t then, void (*fn)(void*, int64_t), void* ctx,
                           const NextJob& next) {
  const int64_t items = first + then;
  if (items > 1 && !t_helper && !omp_in_parallel() && omp_get_max_threads() > 1 &&
      team()->run(fn, ctx, items, first, next))
    return;
  for (int64_t i = 0; i < items; ++i) fn(ctx, i);
}

}  // namespace sigma::cpu
