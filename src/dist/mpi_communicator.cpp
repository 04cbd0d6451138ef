// Open MPI behind the Communicator seam (DESIGN §9). Built when SIGMA_MPI is on.
//
// Every collective is started non-blocking and then polled, so that a rank waiting for a peer
// that died or hangs notices it: after dist.timeout_s it prints who waited where and aborts
// the run (MPI_Abort ends every rank; mpirun exits non-zero). Polling backs off to short
// sleeps, which also keeps waiting ranks from spinning on cores that working ranks need.
// Sums are deterministic: the parts are gathered and added by tree_sum in rank order.
#include <mpi.h>

#include <exception>

#include <fmt/format.h>

#include <chrono>
#include <climits>
#include <thread>

#include "core/error.h"
#include "dist/communicator.h"

namespace sigma {

namespace {

int to_int(int64_t n, const char* what) {
  SIGMA_CHECK(n >= 0 && n <= INT_MAX, "{}: {} elements do not fit one MPI message", what, n);
  return int(n);
}

class MpiCommunicator final : public Communicator {
 public:
  MpiCommunicator(MPI_Comm comm, double timeout_s, bool world) : comm_(comm), timeout_s_(timeout_s), world_(world) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
    MPI_Group mine, all;
    MPI_Comm_group(comm_, &mine);
    MPI_Comm_group(MPI_COMM_WORLD, &all);
    std::vector<int> local(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) local[size_t(r)] = r;
    world_ranks_.resize(size_t(size_));
    MPI_Group_translate_ranks(mine, size_, local.data(), all, world_ranks_.data());
    MPI_Group_free(&mine);
    MPI_Group_free(&all);
  }
  ~MpiCommunicator() override {
    if (!world_) {
      MPI_Comm_free(&comm_);
      return;
    }
    // Unwinding an error: leave MPI up, so that the caller can print it and abort_run() end
    // every rank (MPI_Finalize would wait for ranks that are still running).
    if (std::uncaught_exceptions() > 0) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) MPI_Finalize();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  int world_rank(int r) const override { return world_ranks_[size_t(r)]; }

  void all_reduce_sum(float* data, int64_t n) override { sum_all(data, n, MPI_FLOAT); }
  void all_reduce_sum(double* data, int64_t n) override { sum_all(data, n, MPI_DOUBLE); }

  void reduce_scatter_sum(float* out, const float* in, int64_t n) override {
    std::vector<float> parts(size_t(n) * size_t(size_));
    const int c = to_int(n, "reduce_scatter_sum");
    count_uniform(n * int64_t(sizeof(float)));
    MPI_Request req;
    MPI_Ialltoall(in, c, MPI_FLOAT, parts.data(), c, MPI_FLOAT, comm_, &req);
    wait(req, "reduce_scatter_sum");
    std::vector<const float*> p(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) p[size_t(r)] = parts.data() + size_t(r) * size_t(n);
    tree_sum(out, p.data(), size_, n);
  }

  void all_gather(float* out, const float* in, int64_t n) override { gather(out, in, n, MPI_FLOAT, sizeof(float)); }
  void all_gather(double* out, const double* in, int64_t n) override { gather(out, in, n, MPI_DOUBLE, sizeof(double)); }

  void all_gather_v(float* out, const float* in, const int64_t* counts) override {
    std::vector<int> c(static_cast<size_t>(size_)), displ(static_cast<size_t>(size_));
    int64_t at = 0;
    for (int r = 0; r < size_; ++r) {
      c[size_t(r)] = to_int(counts[r], "all_gather_v");
      displ[size_t(r)] = to_int(at, "all_gather_v");
      at += counts[r];
    }
    count_uniform(counts[rank_] * int64_t(sizeof(float)));
    MPI_Request req;
    MPI_Iallgatherv(in, c[size_t(rank_)], MPI_FLOAT, out, c.data(), displ.data(), MPI_FLOAT, comm_, &req);
    wait(req, "all_gather_v");
  }

  void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                    const int64_t* recv_counts) override {
    std::vector<int> sc(static_cast<size_t>(size_)), sd(static_cast<size_t>(size_)), rc(static_cast<size_t>(size_)), rd(static_cast<size_t>(size_));
    std::vector<int64_t> bytes(static_cast<size_t>(size_));
    int64_t s_at = 0, r_at = 0;
    for (int r = 0; r < size_; ++r) {
      sc[size_t(r)] = to_int(send_counts[r], "all_to_all_v");
      rc[size_t(r)] = to_int(recv_counts[r], "all_to_all_v");
      sd[size_t(r)] = to_int(s_at, "all_to_all_v");
      rd[size_t(r)] = to_int(r_at, "all_to_all_v");
      s_at += send_counts[r];
      r_at += recv_counts[r];
      bytes[size_t(r)] = send_counts[r] * int64_t(sizeof(float));
    }
    count(bytes);
    MPI_Request req;
    MPI_Ialltoallv(send, sc.data(), sd.data(), MPI_FLOAT, recv, rc.data(), rd.data(), MPI_FLOAT,
                   comm_, &req);
    wait(req, "all_to_all_v");
  }

  void broadcast(void* data, size_t bytes, int root) override {
    count_uniform(rank_ == root ? int64_t(bytes) : 0);
    MPI_Request req;
    MPI_Ibcast(data, to_int(int64_t(bytes), "broadcast"), MPI_BYTE, root, comm_, &req);
    wait(req, "broadcast");
  }

  void barrier() override {
    count_uniform(0);
    MPI_Request req;
    MPI_Ibarrier(comm_, &req);
    wait(req, "barrier");
  }

  std::unique_ptr<Communicator> split(int color) override {
    MPI_Comm sub;
    MPI_Comm_split(comm_, color, rank_, &sub);  // collective, but short: no peer wait to watch
    return std::make_unique<MpiCommunicator>(sub, timeout_s_, false);
  }

 private:
  template <class T>
  void gather(T* out, const T* in, int64_t n, MPI_Datatype type, size_t elem) {
    count_uniform(n * int64_t(elem));
    MPI_Request req;
    const int c = to_int(n, "all_gather");
    MPI_Iallgather(in, c, type, out, c, type, comm_, &req);
    wait(req, "all_gather");
  }

  template <class T>
  void sum_all(T* data, int64_t n, MPI_Datatype type) {
    std::vector<T> parts(size_t(n) * size_t(size_));
    gather(parts.data(), data, n, type, sizeof(T));
    std::vector<const T*> p(static_cast<size_t>(size_));
    for (int r = 0; r < size_; ++r) p[size_t(r)] = parts.data() + size_t(r) * size_t(n);
    tree_sum(data, p.data(), size_, n);
  }

  // Polls until `req` completes; aborts the run past the timeout.
  void wait(MPI_Request& req, const char* what) {
    using Clock = std::chrono::steady_clock;
    const auto start = Clock::now();
    int done = 0, polls = 0;
    auto nap = std::chrono::microseconds(20);
    while (true) {
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (done) return;
      if (++polls < 200) continue;
      const double waited = std::chrono::duration<double>(Clock::now() - start).count();
      if (timeout_s_ > 0 && waited > timeout_s_) {
        int me = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &me);
        fmt::print(stderr, "sigma: error: rank {} waited {:.0f} s in {} for the other ranks "
                   "(dist.timeout_s = {}): a rank died or hangs; aborting the run\n", me,
                   waited, what, timeout_s_);
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 3);
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  double timeout_s_;
  bool world_;
  std::vector<int> world_ranks_;
};

}  // namespace

std::unique_ptr<Communicator> make_mpi_world(double timeout_s) {
  int ready = 0;
  MPI_Initialized(&ready);
  if (!ready) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  }
  return std::make_unique<MpiCommunicator>(MPI_COMM_WORLD, timeout_s, true);
}

void abort_run(int exit_code) {
  int init = 0, fin = 0;
  MPI_Initialized(&init);
  MPI_Finalized(&fin);
  int size = 1;
  if (init && !fin) MPI_Comm_size(MPI_COMM_WORLD, &size);
  if (init && !fin && size > 1) MPI_Abort(MPI_COMM_WORLD, exit_code);
}

}  // namespace sigma
