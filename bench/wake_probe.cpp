// wake_probe: what waking a sleeping thread costs on this machine (docs/benchmarks.md, issue
// 12, "the spin team"). Two threads pass a token back and forth through one atomic, after the
// caller has run alone for GAP microseconds; once waiting on a futex (std::atomic::wait, as a
// passive OpenMP thread does), once spinning. The difference per round trip is the price of a
// wake-up of a partner that had time to fall asleep.
//   wake_probe [GAP_US...]   (default 0 20 100 500)
#include <immintrin.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

void wait_for(std::atomic<int>& a, int want, bool spin) {
  for (int v; (v = a.load()) != want;)
    if (spin) _mm_pause();
    else a.wait(v);
}

// Microseconds per round trip, including the gap.
double round_trip(bool spin, int gap_us, int rounds) {
  std::atomic<int> a{0};
  std::thread partner([&] {
    for (int i = 0; i < rounds; ++i) {
      wait_for(a, 2 * i + 1, spin);
      a.store(2 * i + 2);
      if (!spin) a.notify_one();
    }
  });
  const auto t0 = Clock::now();
  for (int i = 0; i < rounds; ++i) {
    const auto until = Clock::now() + std::chrono::microseconds(gap_us);
    while (Clock::now() < until) {
    }
    a.store(2 * i + 1);
    if (!spin) a.notify_one();
    wait_for(a, 2 * i + 2, spin);
  }
  const double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
  partner.join();
  return us / rounds;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> gaps;
  for (int i = 1; i < argc; ++i) gaps.push_back(std::atoi(argv[i]));
  if (gaps.empty()) gaps = {0, 20, 100, 500};
  std::printf("gap_us futex_us spin_us wake_cost_us\n");
  for (int gap : gaps) {
    const int rounds = gap >= 100 ? 2000 : 10000;
    const double futex = round_trip(false, gap, rounds), spin = round_trip(true, gap, rounds);
    std::printf("%6d %8.1f %7.1f %12.1f\n", gap, futex, spin, futex - spin);
  }
}
