// The communicator seam (DESIGN §8-§9, marian's ICommunicator): the collectives a training
// step needs, so that data, expert and tensor parallelism plug in without touching the step.
// Counts are in elements. Every rank calls every collective in the same order. SingleProcess
// is the identity (one rank); MpiCommunicator (dist/mpi_*) runs them on Open MPI; NCCL comes
// with a device that can test it.
//
// Memory contract: every buffer a collective takes may be DEVICE memory of the active ops
// backend (kernels/ops.h: tensors made by ops::empty, as NCCL takes) or host memory, each
// buffer either (ops::is_device tells them apart). Tensor parallelism hands its activations
// and gradients over where they lie; callers need not stage. The public collectives below
// are not virtual: for an implementation that addresses host memory only (all of today's:
// MPI over TCP or shared memory, SingleProcess, the tests' thread ranks) they stage each device
// buffer through the ops front (ops::download before, ops::upload after), so that no
// communicator dereferences a device pointer itself, and pass host buffers straight through
// (on a host backend, cpu or ref, every buffer is host memory: no copy at all). An
// implementation that takes device memory natively (NCCL, a CUDA-aware MPI) says so with
// device_native() and gets every buffer as given. Staging moves bytes only: the sums are
// the implementation's, in its order, so they are the same bits either way.
//
// Determinism: every reduction here adds in a fixed order that depends only on the number of
// ranks (tree_sum over rank order), never on message arrival, so a run repeats bit for bit.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace sigma {

// What this rank sent: collective calls and payload bytes per destination (world ranks, self
// included), for the benchmarks and for the test that no token leaves its group.
// A non-blocking collective in flight (Communicator::start_*). Its buffers must stay alive and
// untouched until it is complete. test() advances it and says whether it is complete (every
// MPI call advances every request in flight, so testing one advances all); wait() completes it,
// ending the run as a blocking collective does when a peer never takes part (dist.timeout_s).
// Destroying one that is not complete waits for it first.
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  virtual bool test() = 0;
  virtual void wait() = 0;
};

struct CommStats {
  int64_t calls = 0;
  std::vector<int64_t> bytes_to;  // [world size]
  int64_t bytes() const;
};

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // This communicator's rank r as a rank of the world (the process group of the run).
  virtual int world_rank(int r) const { return r; }

  // Counts are size_t: a collective may exceed MPI's int counts (2^31 elements); the MPI
  // implementation sends such a one in chunks (max_message_elements). Buffers: device or host
  // memory (the contract above).
  // data[n] = sum over ranks of data[n]: every rank gets the same bits (tree_sum in rank order).
  void all_reduce_sum(float* data, size_t n);
  void all_reduce_sum(double* data, size_t n);
  // out[n] = the sum over ranks of in[rank * n .. rank * n + n) (in holds size() * n).
  void reduce_scatter_sum(float* out, const float* in, size_t n);
  // out[counts[rank()]] = the sum over ranks of the part each holds for this rank: `in` holds
  // counts[r] elements for each rank r, packed in rank order (every rank passes the same
  // counts). Added by tree_sum in rank order: ZeRO's gradients reduced to their owners.
  void reduce_scatter_sum_v(float* out, const float* in, const int64_t* counts);
  // out[size() * n]: rank r's in[n] at out + r * n.
  void all_gather(float* out, const float* in, size_t n);
  void all_gather(double* out, const double* in, size_t n);
  // out[size() * bytes]: rank r's bytes at out + r * bytes (start-up agreement, small records).
  void all_gather_bytes(void* out, const void* in, size_t bytes);
  // out[sum of counts]: rank r's in[counts[r]] packed in rank order.
  void all_gather_v(float* out, const float* in, const int64_t* counts);
  // Personalised exchange: send_counts[r] elements of `send` (packed in rank order) go to rank
  // r; recv receives recv_counts[r] elements from rank r, packed in rank order.
  void all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                    const int64_t* recv_counts);
  // bytes of data from rank `root` to every rank.
  void broadcast(void* data, size_t bytes, int root);
  // Non-blocking all_to_all_v, all_gather_v and reduce_scatter_sum_v (ZeRO's exchanges
  // overlapped with compute, docs/distributed.md "Communication hidden behind compute"): the
  // same results as the blocking calls, delivered when the PendingOp completes (test() also
  // moves a host-first op on to its second round). Every rank starts them in the same order
  // (they are matched in that order) and may start others before completing one. HOST buffers
  // only. An implementation without non-blocking calls (SingleProcess, the tests' thread
  // ranks) runs the blocking call here and returns a completed op.
  std::unique_ptr<PendingOp> start_all_to_all_v(const float* send, const int64_t* send_counts,
                                                float* recv, const int64_t* recv_counts);
  std::unique_ptr<PendingOp> start_all_gather_v(float* out, const float* in, const int64_t* counts);
  std::unique_ptr<PendingOp> start_reduce_scatter_sum_v(float* out, const float* in,
                                                        const int64_t* counts);
  virtual void barrier() = 0;
  // The ranks with the same `color` form a new communicator, ordered by rank here; every rank
  // calls it (collective). Expert groups exchange tokens on theirs.
  virtual std::unique_ptr<Communicator> split(int color) = 0;

  const CommStats& stats() const { return stats_; }
  // Where this communicator's ranks live and which path its sums and gathers take across hosts
  // (dist/host_first.h), in one line; empty when its ranks share one host (or it cannot tell).
  virtual std::string host_layout() const { return {}; }

 protected:
  // The implementations, with the public collectives' meaning. Their buffers are host memory,
  // or as given where device_native() is true.
  virtual bool device_native() const { return false; }
  virtual void do_all_reduce_sum(float* data, size_t n) = 0;
  virtual void do_all_reduce_sum(double* data, size_t n) = 0;
  virtual void do_reduce_scatter_sum(float* out, const float* in, size_t n) = 0;
  // The default: do_all_to_all_v, then tree_sum over the parts received.
  virtual void do_reduce_scatter_sum_v(float* out, const float* in, const int64_t* counts);
  virtual void do_all_gather(float* out, const float* in, size_t n) = 0;
  virtual void do_all_gather(double* out, const double* in, size_t n) = 0;
  virtual void do_all_gather_bytes(void* out, const void* in, size_t bytes);  // by broadcasts
  virtual void do_all_gather_v(float* out, const float* in, const int64_t* counts) = 0;
  virtual void do_all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                               const int64_t* recv_counts) = 0;
  virtual void do_broadcast(void* data, size_t bytes, int root) = 0;
  // The non-blocking calls; the defaults run the blocking ones and return a completed op.
  virtual std::unique_ptr<PendingOp> do_start_all_to_all_v(const float* send,
                                                           const int64_t* send_counts, float* recv,
                                                           const int64_t* recv_counts);
  virtual std::unique_ptr<PendingOp> do_start_all_gather_v(float* out, const float* in,
                                                           const int64_t* counts);
  // The default: do_start_all_to_all_v, and tree_sum over the parts when it completes.
  virtual std::unique_ptr<PendingOp> do_start_reduce_scatter_sum_v(float* out, const float* in,
                                                                   const int64_t* counts);

  // Records one call that sends bytes_to_rank[r] bytes to this communicator's rank r.
  void count(const std::vector<int64_t>& bytes_to_rank);
  void count_uniform(int64_t bytes_each);  // the same to every rank
  CommStats stats_;
  int world_size_ = 1;
};

// One process: every collective is the identity (or a copy).
class SingleProcess final : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void barrier() override {}
  std::unique_ptr<Communicator> split(int) override { return std::make_unique<SingleProcess>(); }

 protected:
  void do_all_reduce_sum(float*, size_t) override {}
  void do_all_reduce_sum(double*, size_t) override {}
  void do_reduce_scatter_sum(float* out, const float* in, size_t n) override;
  void do_all_gather(float* out, const float* in, size_t n) override;
  void do_all_gather(double* out, const double* in, size_t n) override;
  void do_all_gather_v(float* out, const float* in, const int64_t* counts) override;
  void do_all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                       const int64_t* recv_counts) override;
  void do_broadcast(void*, size_t, int root) override;
};

// The most elements one MPI message carries (MPI counts are int): longer collectives go in
// chunks of this many, which also bounds their temporary buffers. Settable for tests, which
// check the chunked paths on small data.
size_t max_message_elements();
void set_max_message_elements(size_t n);

// out[i] = the sum of parts[0..P)[i] added as a fixed binary tree: the first 2^k parts (the
// largest power of two below P) and the rest summed recursively, then added. A tree over
// R * 2^a parts equals the tree over R blocks of 2^a: per-rank subtotals of aligned
// power-of-two blocks combine to the one-rank result bit for bit.
void tree_sum(float* out, const float* const* parts, int P, int64_t n);
void tree_sum(double* out, const double* const* parts, int P, int64_t n);

// tree_sum over leaves that arrive one at a time (a step's micro-batches): a binary counter
// of partial sums, so memory grows with log2 of the leaves, folded from the top by finish().
// The result equals tree_sum over all the leaves bit for bit.
class TreeAccumulator {
 public:
  void push(std::vector<float> leaf);  // the next leaf
  std::vector<float> finish();         // the total; empties the accumulator
  bool empty() const { return stack_.empty(); }

 private:
  std::vector<std::pair<int, std::vector<float>>> stack_;  // (level, partial sum)
};

// The run's process group: MPI's world when started by mpirun (SIGMA_MPI builds), otherwise a
// SingleProcess. A collective that waits longer than timeout_s for the other ranks aborts the
// whole run with an error that says so (a rank died or hangs).
std::unique_ptr<Communicator> make_world(double timeout_s);
// True when this process was started by mpirun (Open MPI's environment).
bool launched_by_mpirun();
// After an error on this rank: ends every rank of a multi-rank run at once (MPI_Abort) rather
// than leaving them to wait for it; nothing in a one-process run.
void abort_run(int exit_code);

}  // namespace sigma
