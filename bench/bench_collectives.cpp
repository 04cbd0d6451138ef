// Collective bandwidth of the MPI communicator on this machine (loopback shared memory):
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np R ./build/bench_collectives
// For each message size: all_to_all_v (every rank sends size/R bytes to each rank) and
// all_gather_v (every rank contributes size/R bytes), median of 9 timed calls after 2 warm-ups.
// Algorithm bandwidth = bytes this rank sends to the others / time.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <vector>

#include "dist/communicator.h"

using namespace sigma;

namespace {

template <class F>
double median_seconds(Communicator& comm, F&& f) {
  std::vector<double> t;
  for (int i = 0; i < 11; ++i) {
    comm.barrier();
    const auto a = std::chrono::steady_clock::now();
    f();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
    if (i >= 2) t.push_back(s);
  }
  std::sort(t.begin(), t.end());
  double worst = t[t.size() / 2];  // the slowest rank's median is the collective's time
  std::vector<double> all(size_t(comm.size()));
  comm.all_gather(all.data(), &worst, 1);
  return *std::max_element(all.begin(), all.end());
}

}  // namespace

int main() {
  const auto world = make_world(60);
  Communicator& c = *world;
  const int R = c.size();
  if (c.rank() == 0)
    fmt::print("ranks {}\n{:>10} {:>14} {:>12} {:>14} {:>12}\n", R, "bytes/rank", "all_to_all_v s",
               "GB/s", "all_gather_v s", "GB/s");
  for (int64_t bytes = 1 << 16; bytes <= (int64_t(1) << 26); bytes *= 4) {
    const int64_t n = bytes / 4 / R;  // floats to each rank
    std::vector<float> send(size_t(n * R), 1.0f), recv(size_t(n * R));
    std::vector<int64_t> counts(size_t(R), n);
    const double a2a = median_seconds(c, [&] { c.all_to_all_v(send.data(), counts.data(), recv.data(), counts.data()); });
    const double ag = median_seconds(c, [&] { c.all_gather_v(recv.data(), send.data(), counts.data()); });
    const double off_rank = double(n) * 4 * (R - 1);  // bytes leaving this rank
    if (c.rank() == 0)
      fmt::print("{:>10} {:>14.6f} {:>12.2f} {:>14.6f} {:>12.2f}\n", bytes, a2a, off_rank / a2a / 1e9,
                 ag, off_rank / ag / 1e9);
  }
  return 0;
}
