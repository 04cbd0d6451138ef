// Collective bandwidth of the MPI communicator on this machine (loopback shared memory):
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np R ./build/bench_collectives [MIN MAX]
// For each message size: all_to_all_v (every rank sends size/R bytes to each rank) and
// all_gather_v (every rank contributes size/R bytes), median of 9 timed calls after 2 warm-ups.
// Algorithm bandwidth = bytes this rank sends to the others / time. Then all_reduce_sum of a
// vector of `size` bytes (tensor parallelism's collective): its time and the bytes that left
// this rank per call (the communicator's own count).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
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

int main(int argc, char** argv) {
  // Message sizes from MIN to MAX bytes, times 4 (arguments; default 64 KiB to 64 MiB).
  const int64_t lo = argc > 1 ? std::atoll(argv[1]) : int64_t(1) << 16;
  const int64_t hi = argc > 2 ? std::atoll(argv[2]) : int64_t(1) << 26;
  const auto world = make_world(60);
  Communicator& c = *world;
  const int R = c.size();
  if (c.rank() == 0)
    fmt::print("ranks {}\n{:>10} {:>14} {:>12} {:>14} {:>12}\n", R, "bytes/rank", "all_to_all_v s",
               "GB/s", "all_gather_v s", "GB/s");
  for (int64_t bytes = lo; bytes <= hi; bytes *= 4) {
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
  if (c.rank() == 0)
    fmt::print("{:>10} {:>16} {:>20}\n", "bytes", "all_reduce_sum s", "bytes sent/rank/call");
  for (int64_t bytes = lo; bytes <= hi; bytes *= 4) {
    std::vector<float> x(size_t(bytes / 4), 1.0f);
    const double ar = median_seconds(c, [&] { c.all_reduce_sum(x.data(), x.size()); });
    const std::vector<int64_t> before = c.stats().bytes_to;  // one more call, counted
    c.all_reduce_sum(x.data(), x.size());
    int64_t sent = 0;
    for (int r = 0; r < R; ++r)
      if (r != c.rank()) sent += c.stats().bytes_to[size_t(r)] - before[size_t(r)];
    if (c.rank() == 0) fmt::print("{:>10} {:>16.6f} {:>20}\n", bytes, ar, sent);
  }
  return 0;
}
