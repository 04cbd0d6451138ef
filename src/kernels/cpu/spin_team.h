// Helper threads that wait for work by spinning, for kernels of tens of microseconds that run
// back to back: batch-1 decoding streams one GEMV per weight matrix, 33 a token at d = 512.
// Under OpenMP's passive wait (sigma's default, apps/sigma.cpp) an idle thread sleeps at once,
// and waking a sleeping core costs 45-65 us on this machine (a VM without halt polling:
// docs/benchmarks.md, issue 12), about what a decode GEMV takes. A helper here spins for up to
// kSpinBudget after each job, yielding its core to any other runnable thread as it spins, then
// sleeps until the next job.
//
// A job is a count of items that the caller and the helpers claim one at a time, so the caller
// never waits for a helper that has not started (one preempted on a busy machine, or asleep):
// it runs the unclaimed items itself, and waits only for items already running.
#pragma once
#include <chrono>
#include <cstdint>
#include <type_traits>

namespace sigma::cpu {

constexpr auto kSpinBudget = std::chrono::microseconds(200);

// Memory a job's threads may pull into their caches (L2) when they would otherwise only wait:
// the first bytes of the items the *next* job will likely give them (decode's GEMVs run the same
// products in the same order every token: kernels/cpu/gemv.cpp predicts them). A hint: nothing
// is read, so a wrong one costs bandwidth, never a result. The caller claims a job's items
// first, so item 0 is likely the caller's and item 1 a helper's.
struct Stream {
  const void* p = nullptr;
  int64_t bytes = 0;
};
struct NextJob {
  Stream caller;  // prefetched by the caller while it waits for this job's last items
  Stream helper;  // by a helper after this job, while it spins for the next one
};
// At most this many bytes of each stream are prefetched (a quarter of L2, at most 256 KiB).
int64_t prefetch_budget();

namespace detail {
void for_each_item(int64_t first, int64_t then, void (*fn)(void* ctx, int64_t item), void* ctx,
                   const NextJob& next);
}

// Threads that may run a job's items (OpenMP's thread count): for sizing the items.
int team_threads();

// Items the helpers (not the callers) have run since the process started: whether a job was
// shared depends on timing, so tests of a kernel's threaded path check this.
int64_t helper_items();

// Runs fn(item) once for each item in [0, items), on the calling thread and any free helpers,
// and returns when all have run. Only the calling thread inside an OpenMP region, on a helper,
// or while another thread's job runs. fn must not throw.
// With `next`, the threads prefetch its streams where they would wait (see NextJob).
template <class Fn>
void for_each_item(int64_t items, Fn&& fn, const NextJob& next = {}) {
  using F = std::remove_reference_t<Fn>;
  detail::for_each_item(
      items, 0, [](void* c, int64_t i) { (*static_cast<F*>(c))(i); }, &fn, next);
}

// Runs fn(item) for the items [0, first), then for [first, first + then): an item of the second
// phase starts only when every item of the first has returned. One job where two
// for_each_item calls would start the helpers and wait for them twice: a decode GEMV's chunk
// products and then the sums of their partials (kernels/cpu/gemv.cpp). Items are claimed in
// order, so a thread waiting in the second phase waits only for items other threads run.
template <class Fn>
void for_each_item_phased(int64_t first, int64_t then, Fn&& fn, const NextJob& next = {}) {
  using F = std::remove_reference_t<Fn>;
  detail::for_each_item(
      first, then, [](void* c, int64_t i) { (*static_cast<F*>(c))(i); }, &fn, next);
}

}  // namespace sigma::cpu
