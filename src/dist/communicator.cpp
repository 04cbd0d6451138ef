#include "dist/communicator.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <cstring>
#include <exception>
#include <numeric>

#include "core/error.h"
#include "dist/rank_list.h"
#include "kernels/ops.h"

namespace sigma {

int64_t CommStats::bytes() const { return std::accumulate(bytes_to.begin(), bytes_to.end(), int64_t(0)); }

void Communicator::count(const std::vector<int64_t>& bytes_to_rank) {
  stats_.calls += 1;
  if (stats_.bytes_to.empty()) stats_.bytes_to.assign(size_t(std::max(world_size_, size())), 0);
  for (size_t r = 0; r < bytes_to_rank.size(); ++r)
    stats_.bytes_to[size_t(world_rank(int(r)))] += bytes_to_rank[r];
}

void Communicator::count_uniform(int64_t bytes_each) {
  count(std::vector<int64_t>(size_t(size()), bytes_each));
}

// Every rank's record in turn: any implementation's broadcast gives it (MPI's overrides it).
void Communicator::do_all_gather_bytes(void* out, const void* in, size_t bytes) {
  char* o = static_cast<char*>(out);
  std::memcpy(o + size_t(rank()) * bytes, in, bytes);
  for (int r = 0; r < size(); ++r) do_broadcast(o + size_t(r) * bytes, bytes, r);
}

namespace {

// One buffer of a collective as a host-only implementation sees it (the contract in
// communicator.h): the buffer itself when it is host memory or the implementation takes device
// memory; otherwise a host copy, downloaded first when the collective reads the buffer and
// uploaded by done() when it writes it.
class Staged {
 public:
  Staged(const void* p, size_t bytes, bool read, bool native)
      : p_(const_cast<void*>(p)), bytes_(bytes) {
    if (native || bytes == 0 || !ops::is_device(p)) return;
    copy_.reset(new std::byte[bytes]);
    if (read) ops::download(copy_.get(), p, bytes);
  }
  template <class T> T* as() const { return static_cast<T*>(copy_ ? copy_.get() : p_); }
  void done() {
    if (copy_) ops::upload(p_, copy_.get(), bytes_);
  }

 private:
  void* p_;
  size_t bytes_;
  std::unique_ptr<std::byte[]> copy_;
};

size_t total(const int64_t* counts, int P) {
  int64_t n = 0;
  for (int r = 0; r < P; ++r) n += counts[r];
  return size_t(n);
}

}  // namespace

void Communicator::all_reduce_sum(float* data, size_t n) {
  Staged d(data, n * sizeof(float), true, device_native());
  do_all_reduce_sum(d.as<float>(), n);
  d.done();
}

void Communicator::all_reduce_sum(double* data, size_t n) {
  Staged d(data, n * sizeof(double), true, device_native());
  do_all_reduce_sum(d.as<double>(), n);
  d.done();
}

void Communicator::reduce_scatter_sum(float* out, const float* in, size_t n) {
  Staged i(in, size_t(size()) * n * sizeof(float), true, device_native());
  Staged o(out, n * sizeof(float), false, device_native());
  do_reduce_scatter_sum(o.as<float>(), i.as<const float>(), n);
  o.done();
}

void Communicator::reduce_scatter_sum_v(float* out, const float* in, const int64_t* counts) {
  Staged i(in, total(counts, size()) * sizeof(float), true, device_native());
  Staged o(out, size_t(counts[rank()]) * sizeof(float), false, device_native());
  do_reduce_scatter_sum_v(o.as<float>(), i.as<const float>(), counts);
  o.done();
}

void Communicator::all_gather(float* out, const float* in, size_t n) {
  Staged i(in, n * sizeof(float), true, device_native());
  Staged o(out, size_t(size()) * n * sizeof(float), false, device_native());
  do_all_gather(o.as<float>(), i.as<const float>(), n);
  o.done();
}

void Communicator::all_gather(double* out, const double* in, size_t n) {
  Staged i(in, n * sizeof(double), true, device_native());
  Staged o(out, size_t(size()) * n * sizeof(double), false, device_native());
  do_all_gather(o.as<double>(), i.as<const double>(), n);
  o.done();
}

void Communicator::all_gather_bytes(void* out, const void* in, size_t bytes) {
  Staged i(in, bytes, true, device_native());
  Staged o(out, size_t(size()) * bytes, false, device_native());
  do_all_gather_bytes(o.as<void>(), i.as<const void>(), bytes);
  o.done();
}

void Communicator::all_gather_v(float* out, const float* in, const int64_t* counts) {
  Staged i(in, size_t(counts[rank()]) * sizeof(float), true, device_native());
  Staged o(out, total(counts, size()) * sizeof(float), false, device_native());
  do_all_gather_v(o.as<float>(), i.as<const float>(), counts);
  o.done();
}

namespace {
class CompletedOp final : public PendingOp {
 public:
  bool test() override { return true; }
  void wait() override {}
};

void check_host(const void* p, const char* what) {
  SIGMA_CHECK(p == nullptr || !ops::is_device(p), "{}: a non-blocking collective takes host "
              "buffers only (this one is device memory)", what);
}
}  // namespace

std::unique_ptr<PendingOp> Communicator::do_start_all_to_all_v(const float* send,
                                                               const int64_t* send_counts,
                                                               float* recv,
                                                               const int64_t* recv_counts) {
  do_all_to_all_v(send, send_counts, recv, recv_counts);
  return std::make_unique<CompletedOp>();
}

std::unique_ptr<PendingOp> Communicator::do_start_all_gather_v(float* out, const float* in,
                                                               const int64_t* counts) {
  do_all_gather_v(out, in, counts);
  return std::make_unique<CompletedOp>();
}

void Communicator::do_reduce_scatter_sum_v(float* out, const float* in, const int64_t* counts) {
  const int R = size();
  const size_t n = size_t(counts[rank()]);
  const std::vector<int64_t> from(static_cast<size_t>(R), static_cast<int64_t>(n));
  std::vector<float> parts(size_t(R) * n);
  do_all_to_all_v(in, counts, parts.data(), from.data());
  std::vector<const float*> p(static_cast<size_t>(R));
  for (int r = 0; r < R; ++r) p[size_t(r)] = parts.data() + size_t(r) * n;
  tree_sum(out, p.data(), R, int64_t(n));
}

namespace {
// The default non-blocking reduce-scatter: the parts' exchange in flight, their sum taken when
// it completes.
class SumWhenComplete final : public PendingOp {
 public:
  SumWhenComplete(int R, float* out, size_t n) : R_(R), n_(n), out_(out), parts_(size_t(R) * n) {}
  void start(std::unique_ptr<PendingOp> exchange) { exchange_ = std::move(exchange); }
  ~SumWhenComplete() override {
    if (!summed_ && exchange_ && std::uncaught_exceptions() == 0) wait();
  }
  float* parts() { return parts_.data(); }
  bool test() override {
    if (!summed_ && exchange_->test()) sum();
    return summed_;
  }
  void wait() override {
    if (summed_) return;
    exchange_->wait();
    sum();
  }

 private:
  void sum() {
    std::vector<const float*> p(static_cast<size_t>(R_));
    for (int r = 0; r < R_; ++r) p[size_t(r)] = parts_.data() + size_t(r) * n_;
    tree_sum(out_, p.data(), R_, int64_t(n_));
    parts_ = {};
    summed_ = true;
  }
  int R_;
  size_t n_;
  float* out_;
  std::vector<float> parts_;
  std::unique_ptr<PendingOp> exchange_;
  bool summed_ = false;
};
}  // namespace

std::unique_ptr<PendingOp> Communicator::do_start_reduce_scatter_sum_v(float* out, const float* in,
                                                                       const int64_t* counts) {
  const int R = size();
  const size_t n = size_t(counts[rank()]);
  auto op = std::make_unique<SumWhenComplete>(R, out, n);
  const std::vector<int64_t> from(static_cast<size_t>(R), static_cast<int64_t>(n));
  op->start(do_start_all_to_all_v(in, counts, op->parts(), from.data()));
  return op;
}

std::unique_ptr<PendingOp> Communicator::start_reduce_scatter_sum_v(float* out, const float* in,
                                                                    const int64_t* counts) {
  check_host(in, "start_reduce_scatter_sum_v");
  check_host(out, "start_reduce_scatter_sum_v");
  return do_start_reduce_scatter_sum_v(out, in, counts);
}

std::unique_ptr<PendingOp> Communicator::start_all_to_all_v(const float* send,
                                                            const int64_t* send_counts,
                                                            float* recv,
                                                            const int64_t* recv_counts) {
  check_host(send, "start_all_to_all_v");
  check_host(recv, "start_all_to_all_v");
  return do_start_all_to_all_v(send, send_counts, recv, recv_counts);
}

std::unique_ptr<PendingOp> Communicator::start_all_gather_v(float* out, const float* in,
                                                            const int64_t* counts) {
  check_host(in, "start_all_gather_v");
  check_host(out, "start_all_gather_v");
  return do_start_all_gather_v(out, in, counts);
}

void Communicator::all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                                const int64_t* recv_counts) {
  Staged s(send, total(send_counts, size()) * sizeof(float), true, device_native());
  Staged r(recv, total(recv_counts, size()) * sizeof(float), false, device_native());
  do_all_to_all_v(s.as<const float>(), send_counts, r.as<float>(), recv_counts);
  r.done();
}

void Communicator::broadcast(void* data, size_t bytes, int root) {
  Staged d(data, bytes, rank() == root, device_native());
  do_broadcast(d.as<void>(), bytes, root);
  d.done();
}

namespace {
size_t g_max_message = size_t(1) << 30;  // elements; below INT_MAX for every MPI type
}  // namespace

size_t max_message_elements() { return g_max_message; }
void set_max_message_elements(size_t n) {
  SIGMA_CHECK(n >= 1 && n <= size_t(1) << 30, "max_message_elements: {} is not in [1, 2^30]", n);
  g_max_message = n;
}

void SingleProcess::do_reduce_scatter_sum(float* out, const float* in, size_t n) {
  if (out != in) std::memmove(out, in, n * sizeof(float));
}

void SingleProcess::do_all_gather(float* out, const float* in, size_t n) {
  if (out != in) std::memmove(out, in, n * sizeof(float));
}

void SingleProcess::do_all_gather(double* out, const double* in, size_t n) {
  if (out != in) std::memmove(out, in, n * sizeof(double));
}

void SingleProcess::do_all_gather_v(float* out, const float* in, const int64_t* counts) {
  do_all_gather(out, in, counts[0]);
}

void SingleProcess::do_all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                                    const int64_t* recv_counts) {
  SIGMA_CHECK(send_counts[0] == recv_counts[0], "all_to_all_v: one rank sends {} elements to "
              "itself but expects {}", send_counts[0], recv_counts[0]);
  if (recv != send) std::memmove(recv, send, size_t(send_counts[0]) * sizeof(float));
}

void SingleProcess::do_broadcast(void*, size_t, int root) {
  SIGMA_CHECK(root == 0, "broadcast from rank {} in a single-process run", root);
}

namespace {

template <class T>
void tree_sum_impl(T* out, const T* const* parts, int P, int64_t n) {
  if (P == 1) {
    if (out != parts[0]) std::memmove(out, parts[0], size_t(n) * sizeof(T));
    return;
  }
  if (P == 2) {
    const T *a = parts[0], *b = parts[1];
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    return;
  }
  int left = 1;
  while (left * 2 < P) left *= 2;
  std::vector<T> right(static_cast<size_t>(n));
  tree_sum_impl(right.data(), parts + left, P - left, n);
  tree_sum_impl(out, parts, left, n);
  for (int64_t i = 0; i < n; ++i) out[i] += right[size_t(i)];
}

}  // namespace

void tree_sum(float* out, const float* const* parts, int P, int64_t n) {
  SIGMA_CHECK(P >= 1, "tree_sum of no parts");
  tree_sum_impl(out, parts, P, n);
}

void tree_sum(double* out, const double* const* parts, int P, int64_t n) {
  SIGMA_CHECK(P >= 1, "tree_sum of no parts");
  tree_sum_impl(out, parts, P, n);
}

namespace {

void add_into(std::vector<float>& into, const std::vector<float>& x) {
  float* a = into.data();
  const float* b = x.data();
  const int64_t n = int64_t(into.size());
#pragma omp parallel for schedule(static) if (n > (int64_t(1) << 16))
  for (int64_t i = 0; i < n; ++i) a[i] += b[i];
}

}  // namespace

void TreeAccumulator::push(std::vector<float> leaf) {
  SIGMA_CHECK(stack_.empty() || stack_.back().second.size() == leaf.size(),
              "TreeAccumulator: a leaf of {} elements after leaves of {}", leaf.size(),
              stack_.back().second.size());
  stack_.push_back({0, std::move(leaf)});
  while (stack_.size() >= 2 && stack_[stack_.size() - 2].first == stack_.back().first) {
    auto right = std::move(stack_.back());
    stack_.pop_back();
    add_into(stack_.back().second, right.second);
    stack_.back().first += 1;
  }
}

std::vector<float> TreeAccumulator::finish() {
  SIGMA_CHECK(!stack_.empty(), "TreeAccumulator: no leaf");
  std::vector<float> total = std::move(stack_.back().second);
  for (size_t i = stack_.size() - 1; i-- > 0;) {  // S1 + (S2 + (... + Sm))
    add_into(stack_[i].second, total);
    total.swap(stack_[i].second);
  }
  stack_.clear();
  return total;
}

bool launched_by_mpirun() { return std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr; }

#ifdef SIGMA_WITH_MPI
std::unique_ptr<Communicator> make_mpi_world(double timeout_s);  // dist/mpi_communicator.cpp
#else
void abort_run(int) {}
#endif

std::unique_ptr<Communicator> make_world(double timeout_s) {
  if (!launched_by_mpirun()) return std::make_unique<SingleProcess>();
#ifdef SIGMA_WITH_MPI
  return make_mpi_world(timeout_s);
#else
  (void)timeout_s;
  const char* n = std::getenv("OMPI_COMM_WORLD_SIZE");
  SIGMA_CHECK(std::atoi(n) <= 1, "started by mpirun with {} ranks, but this sigma was built "
              "without MPI (configure with -DSIGMA_MPI=ON and libopenmpi-dev installed)", n);
  return std::make_unique<SingleProcess>();
#endif
}

std::string rank_list(const std::vector<int>& ranks) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    parts.push_back(j == i ? std::to_string(ranks[i]) : fmt::format("{}-{}", ranks[i], ranks[j]));
    i = j + 1;
  }
  return fmt::format("{}", fmt::join(parts, ", "));
}

}  // namespace sigma
