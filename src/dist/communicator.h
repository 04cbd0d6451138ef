// The communicator seam (DESIGN §8-§9, marian's ICommunicator): the collectives a training
// step needs, so that data and expert parallelism plug in without touching the step. Counts
// are in elements; buffers are on the backend's device. Every rank calls every collective in
// the same order. SingleProcess is the identity (one rank); Open MPI and NCCL come next.
#pragma once
#include <cstddef>
#include <cstdint>

namespace sigma {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;

  // data[n] = sum over ranks of data[n], in a fixed order of ranks (deterministic).
  virtual void all_reduce_sum(float* data, int64_t n) = 0;
  virtual void all_reduce_sum(double* data, int64_t n) = 0;
  // out[n] = the sum over ranks of in[rank * n .. rank * n + n) (in holds size() * n).
  virtual void reduce_scatter_sum(float* out, const float* in, int64_t n) = 0;
  // out[size() * n]: rank r's in[n] at out + r * n.
  virtual void all_gather(float* out, const float* in, int64_t n) = 0;
  // Personalised exchange: send_counts[r] elements of `send` (packed in rank order) go to rank
  // r; recv receives recv_counts[r] elements from rank r, packed in rank order.
  virtual void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                            const int64_t* recv_counts) = 0;
  // bytes of data from rank `root` to every rank.
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  virtual void barrier() = 0;
};

// One process: every collective is the identity (or a copy).
class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_reduce_sum(float*, int64_t) override {}
  void all_reduce_sum(double*, int64_t) override {}
  void reduce_scatter_sum(float* out, const float* in, int64_t n) override;
  void all_gather(float* out, const float* in, int64_t n) override;
  void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                    const int64_t* recv_counts) override;
  void broadcast(void*, size_t, int root) override;
  void barrier() override {}
};

}  // namespace sigma
