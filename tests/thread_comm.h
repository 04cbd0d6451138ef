// R ranks as threads of one process: a Communicator for unit tests of distributed code
// without mpirun. Each collective posts this rank's pointers, meets the others at a barrier,
// copies what it needs, and meets them again. Sums use tree_sum in rank order, as MPI's does.
#pragma once
#include <algorithm>
#include <barrier>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "dist/communicator.h"

namespace sigma::test_ranks {

struct ThreadShared {
  explicit ThreadShared(int n) : size(n), sync(n), posted(size_t(n)), counts(size_t(n)) {}
  int size;
  std::barrier<> sync;
  std::vector<const void*> posted;
  std::vector<const int64_t*> counts;
  std::vector<int> world;  // world rank of each member
  std::mutex mu;
  std::map<int, std::shared_ptr<ThreadShared>> children;  // split: color -> group
};

class ThreadComm final : public Communicator {
 public:
  ThreadComm(std::shared_ptr<ThreadShared> s, int rank, int world_size) : s_(std::move(s)), rank_(rank) {
    world_size_ = world_size;
  }
  int rank() const override { return rank_; }
  int size() const override { return s_->size; }
  int world_rank(int r) const override { return s_->world.empty() ? r : s_->world[size_t(r)]; }

 protected:  // host memory: the base stages device buffers (dist/communicator.h)
  void do_all_reduce_sum(float* x, size_t n) override { sum_all(x, n); }
  void do_all_reduce_sum(double* x, size_t n) override { sum_all(x, n); }
  void do_reduce_scatter_sum(float* out, const float* in, size_t n) override {
    count_uniform(n * 4);
    post(in);
    std::vector<const float*> parts(static_cast<size_t>(size()));
    for (int r = 0; r < size(); ++r) parts[size_t(r)] = static_cast<const float*>(s_->posted[size_t(r)]) + rank_ * n;
    tree_sum(out, parts.data(), size(), n);
    s_->sync.arrive_and_wait();
  }
  void do_all_gather(float* out, const float* in, size_t n) override { gather(out, in, n); }
  void do_all_gather(double* out, const double* in, size_t n) override { gather(out, in, n); }
  void do_all_gather_v(float* out, const float* in, const int64_t* counts) override {
    count_uniform(counts[rank_] * 4);
    post(in);
    for (int r = 0; r < size(); ++r) {
      if (counts[r] > 0) std::memcpy(out, s_->posted[size_t(r)], size_t(counts[r]) * sizeof(float));
      out += counts[r];
    }
    s_->sync.arrive_and_wait();
  }
  void do_all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                       const int64_t* recv_counts) override {
    std::vector<int64_t> bytes(static_cast<size_t>(size()));
    for (int r = 0; r < size(); ++r) bytes[size_t(r)] = send_counts[r] * 4;
    count(bytes);
    s_->counts[size_t(rank_)] = send_counts;
    post(send);
    for (int r = 0; r < size(); ++r) {
      int64_t off = 0;
      for (int q = 0; q < rank_; ++q) off += s_->counts[size_t(r)][q];
      if (s_->counts[size_t(r)][rank_] != recv_counts[r]) std::abort();  // a test bug
      if (recv_counts[r] > 0)  // empty buffers may be null, and memcpy takes no null
        std::memcpy(recv, static_cast<const float*>(s_->posted[size_t(r)]) + off,
                    size_t(recv_counts[r]) * sizeof(float));
      recv += recv_counts[r];
    }
    s_->sync.arrive_and_wait();
  }
  void do_broadcast(void* data, size_t bytes, int root) override {
    count_uniform(rank_ == root ? int64_t(bytes) : 0);
    post(data);
    if (rank_ != root) std::memcpy(data, s_->posted[size_t(root)], bytes);
    s_->sync.arrive_and_wait();
  }
 public:
  void barrier() override {
    count_uniform(0);
    s_->sync.arrive_and_wait();
  }
  std::unique_ptr<Communicator> split(int color) override {
    std::vector<int> colors(static_cast<size_t>(size()));
    int mine = color;
    post(&mine);
    for (int r = 0; r < size(); ++r) colors[size_t(r)] = *static_cast<const int*>(s_->posted[size_t(r)]);
    s_->sync.arrive_and_wait();
    std::vector<int> members;
    for (int r = 0; r < size(); ++r)
      if (colors[size_t(r)] == color) members.push_back(r);
    std::shared_ptr<ThreadShared> child;
    {
      std::lock_guard<std::mutex> lock(s_->mu);
      auto& c = s_->children[color];
      if (!c) {
        c = std::make_shared<ThreadShared>(int(members.size()));
        for (int m : members) c->world.push_back(world_rank(m));
      }
      child = c;
    }
    s_->sync.arrive_and_wait();
    if (rank_ == 0) s_->children.clear();
    s_->sync.arrive_and_wait();
    const int sub_rank = int(std::find(members.begin(), members.end(), rank_) - members.begin());
    return std::make_unique<ThreadComm>(child, sub_rank, world_size_);
  }

 private:
  void post(const void* p) {
    s_->posted[size_t(rank_)] = p;
    s_->sync.arrive_and_wait();
  }
  template <class T>
  void gather(T* out, const T* in, int64_t n) {
    count_uniform(n * int64_t(sizeof(T)));
    post(in);
    for (int r = 0; r < size(); ++r)
      std::memcpy(out + r * n, s_->posted[size_t(r)], size_t(n) * sizeof(T));
    s_->sync.arrive_and_wait();
  }
  template <class T>
  void sum_all(T* x, int64_t n) {
    std::vector<T> all(size_t(n) * size_t(size()));
    gather(all.data(), x, n);
    std::vector<const T*> parts(static_cast<size_t>(size()));
    for (int r = 0; r < size(); ++r) parts[size_t(r)] = all.data() + r * n;
    tree_sum(x, parts.data(), size(), n);
  }
  std::shared_ptr<ThreadShared> s_;
  int rank_;
};

// Runs fn(comm) on R threads, one rank each; returns when all are done.
inline void run_ranks(int R, const std::function<void(Communicator&)>& fn) {
  auto shared = std::make_shared<ThreadShared>(R);
  std::vector<std::thread> threads;
  for (int r = 0; r < R; ++r)
    threads.emplace_back([&, r] {
      ThreadComm c(shared, r, R);
      fn(c);
    });
  for (auto& t : threads) t.join();
}

}  // namespace sigma::test_ranks
