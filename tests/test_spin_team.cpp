// The spin team (kernels/cpu/spin_team.h): every item of a job runs exactly once, whoever
// claims it; helpers take part, also after sleeping past their spin budget; nested jobs,
// jobs inside OpenMP regions and jobs from two threads at once run correctly.
#include <gtest/gtest.h>
#include <omp.h>

#include <atomic>
#include <chrono>
#include <thread>
#include <vector>

#include "kernels/cpu/spin_team.h"

using namespace sigma;

namespace {

// Runs a job of `items` items of about `micros` each; counts each item's runs, and whether an
// item ran on a thread other than the caller.
struct Probe {
  std::vector<std::atomic<int>> runs;
  std::atomic<bool> helped{false};
  explicit Probe(int64_t items) : runs(size_t(items)) {}
  void run(int64_t micros) {
    const auto caller = std::this_thread::get_id();
    cpu::for_each_item(int64_t(runs.size()), [&](int64_t i) {
      runs[size_t(i)].fetch_add(1);
      if (std::this_thread::get_id() != caller) helped = true;
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(micros);
      while (std::chrono::steady_clock::now() < until) {
      }
    });
  }
  bool each_once() const {
    for (const auto& r : runs)
      if (r.load() != 1) return false;
    return true;
  }
};

// Jobs until a helper took an item (at most 2 s); with `pause` between jobs, past the budget.
bool helpers_take_part(std::chrono::microseconds pause) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (std::chrono::steady_clock::now() < deadline) {
    Probe p(16);
    p.run(50);
    EXPECT_TRUE(p.each_once());
    if (p.helped) return true;
    std::this_thread::sleep_for(pause);
  }
  return false;
}

}  // namespace

TEST(SpinTeam, EveryItemRunsOnceAndHelpersTakePart) {
  omp_set_num_threads(2);
  ASSERT_EQ(cpu::team_threads(), 2);
  for (int64_t items : {0, 1, 2, 7, 1000}) {
    Probe p(items);
    p.run(1);
    EXPECT_TRUE(p.each_once()) << items << " items";
  }
  EXPECT_TRUE(helpers_take_part(std::chrono::microseconds(0)));
}

TEST(SpinTeam, SleepingHelpersWakeForTheNextJob) {
  omp_set_num_threads(2);
  // Well past kSpinBudget between jobs: the helper sleeps, and the next job must wake it.
  EXPECT_TRUE(helpers_take_part(10 * cpu::kSpinBudget));
}

TEST(SpinTeam, OneThreadAndOpenMpRegionsRunTheItemsOnTheCaller) {
  omp_set_num_threads(1);
  Probe alone(64);
  alone.run(5);
  EXPECT_TRUE(alone.each_once());
  EXPECT_FALSE(alone.helped);
  omp_set_num_threads(2);
#pragma omp parallel num_threads(2)
  {
    Probe inside(64);  // one job per OpenMP thread, each on its own thread
    inside.run(5);
    EXPECT_TRUE(inside.each_once());
    EXPECT_FALSE(inside.helped);
  }
}

TEST(SpinTeam, NestedJobsAndJobsFromTwoThreadsRunEachItemOnce) {
  omp_set_num_threads(2);
  std::vector<std::atomic<int>> runs(64 * 8);
  cpu::for_each_item(64, [&](int64_t i) {
    cpu::for_each_item(8, [&](int64_t j) { runs[size_t(i * 8 + j)].fetch_add(1); });
  });
  for (const auto& r : runs) EXPECT_EQ(r.load(), 1);
  std::atomic<int> failures{0};
  auto client = [&] {
    for (int k = 0; k < 200; ++k) {
      Probe p(33);
      p.run(0);
      if (!p.each_once()) ++failures;
    }
  };
  std::thread a(client), b(client);
  a.join();
  b.join();
  EXPECT_EQ(failures.load(), 0);
}

// A phased job (for_each_item_phased): every item runs once, and no second-phase item starts
// before every first-phase item has returned, whichever thread runs them; the second phase
// items are shared with the helpers too. One thread and an empty phase run in order.
TEST(SpinTeam, PhasedJobsStartTheSecondPhaseAfterTheFirst) {
  auto phased = [](int64_t first, int64_t then, int64_t micros, bool* helped) {
    std::vector<std::atomic<int>> runs(size_t(first + then));
    std::atomic<int64_t> early{0};  // second-phase items that saw a first-phase item unfinished
    const auto caller = std::this_thread::get_id();
    cpu::for_each_item_phased(first, then, [&](int64_t i) {
      if (i >= first)
        for (int64_t k = 0; k < first; ++k)
          if (runs[size_t(k)].load() != 1) ++early;
      // First-phase items of uneven length, so that one thread reaches the second phase while
      // the other still runs a first-phase item.
      const auto until = std::chrono::steady_clock::now() +
                         std::chrono::microseconds(i < first ? micros * (1 + i % 3) : 0);
      while (std::chrono::steady_clock::now() < until) {
      }
      if (std::this_thread::get_id() != caller && helped) *helped = true;
      runs[size_t(i)].fetch_add(1);
    });
    for (const auto& r : runs) EXPECT_EQ(r.load(), 1) << first << " + " << then;
    return early.load();
  };
  omp_set_num_threads(2);
  bool helped = false;
  int64_t early = 0;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (int k = 0; k < 20 || (!helped && std::chrono::steady_clock::now() < deadline); ++k)
    early += phased(5, 3, 40, &helped);
  EXPECT_EQ(early, 0);
  EXPECT_TRUE(helped);
  for (auto [first, then] : {std::pair<int64_t, int64_t>{0, 4}, {4, 0}, {1, 1}, {0, 0}})
    EXPECT_EQ(phased(first, then, 1, nullptr), 0);
  omp_set_num_threads(1);
  EXPECT_EQ(phased(5, 3, 1, nullptr), 0);
  omp_set_num_threads(2);
}

// Jobs that name the next job's streams (NextJob: the caller prefetches its stream while it
// waits, a helper its own while it spins for the next job): still every item once, helpers
// still take part, and a helper with a stream left to prefetch still answers the next job at
// once, whether the streams are larger than the prefetch budget, tiny, unaligned or empty.
TEST(SpinTeam, JobsNamingTheNextJobsStreamsRunEachItemOnce) {
  omp_set_num_threads(2);
  ASSERT_GT(cpu::prefetch_budget(), 0);
  std::vector<float> memory(size_t(4 * cpu::prefetch_budget() / 4));
  const int64_t n = int64_t(memory.size()) * 4;
  const cpu::NextJob hints[] = {{{memory.data(), n}, {memory.data() + memory.size() / 2, n / 2}},
                                {{memory.data() + 3, 100}, {memory.data() + 1, 1}},
                                {{}, {memory.data(), n}},
                                {}};
  std::atomic<bool> helped{false};
  const auto caller = std::this_thread::get_id();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  for (int k = 0; k < 400 || (!helped && std::chrono::steady_clock::now() < deadline); ++k) {
    std::vector<std::atomic<int>> runs(17);
    cpu::for_each_item_phased(
        12, 5,
        [&](int64_t i) {
          runs[size_t(i)].fetch_add(1);
          if (std::this_thread::get_id() != caller) helped = true;
          const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(2);
          while (std::chrono::steady_clock::now() < until) {
          }
        },
        hints[k % 4]);
    for (const auto& r : runs) ASSERT_EQ(r.load(), 1) << "job " << k;
  }
  EXPECT_TRUE(helped);
}
