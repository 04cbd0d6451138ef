// Open MPI behind the Communicator seam (DESIGN §9). Built when SIGMA_MPI is on.
//
// Every collective is started non-blocking and then polled, so that a rank waiting for a peer
// that died or hangs notices it: after dist.timeout_s it asks the other ranks which of them are
// waiting too and which ranks of the world are reachable at all, names the ones that never
// entered the call (or the host whose ranks are all lost), and aborts the run (MPI_Abort ends
// every rank; mpirun exits non-zero; a rank whose abort hangs ends itself). Polling backs off to short sleeps, which also keeps
// waiting ranks from spinning on cores that working ranks need.
// Sums are deterministic: each element's parts are added by tree_sum in rank order (the
// all-reduce as reduce-scatter + all-gather, each piece summed by its owner). Where ranks share
// a host (MPI_Comm_split_type, at start) and hold whole subtrees of that order, sums and gathers
// go host-first (dist/host_first.h): the same additions, fewer bytes between hosts.
// Counts beyond MPI's int go in chunks of max_message_elements(): a strided datatype places
// each rank's chunk, and the personalised exchanges are point-to-point messages.
#include <mpi.h>
#include <unistd.h>

#include <exception>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/error.h"
#include "dist/communicator.h"
#include "dist/host_first.h"
#include "dist/rank_list.h"

namespace sigma {

namespace {

constexpr int kExchangeTag = 7100;  // point-to-point pieces of all_to_all_v / all_gather_v
constexpr int kWaitingTag = 7101;   // "I am waiting in call #k" after a timeout
constexpr int kAliveTag = 7102;     // "I am alive", on the liveness communicator
constexpr int kOverlapTag = 7103;   // the non-blocking exchanges (start_all_to_all_v, ...)

// Which ranks a rank that timed out can still reach, across every communicator of the process
// (docs/distributed.md, "Faults"): the world's host names, gathered at start while every rank
// is reachable, and a duplicate of the world on which a rank that timed out tells every other
// rank it is alive. A rank waiting in any collective answers once it sees such a message, so
// after a short grace the ranks not heard from are the lost ones; when they are every rank of
// a host, the message names the host (its link is down or it died).
struct Liveness {
  MPI_Comm comm = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::vector<std::string> hosts;  // [world rank]
  int64_t alive = 1;
  bool said = false;
  std::vector<MPI_Request> sends;

  void say() {
    if (said || comm == MPI_COMM_NULL) return;
    said = true;
    for (int r = 0; r < size; ++r)
      if (r != rank) {
        sends.emplace_back();
        MPI_Isend(&alive, 1, MPI_INT64_T, r, kAliveTag, comm, &sends.back());
      }
  }
  // Called while waiting: a rank that timed out asked who is alive; this one is.
  void serve() {
    if (said || comm == MPI_COMM_NULL) return;
    int asked = 0;
    MPI_Iprobe(MPI_ANY_SOURCE, kAliveTag, comm, &asked, MPI_STATUS_IGNORE);
    if (asked) say();
  }
  // After a timeout: says so and listens; `heard[r]` becomes 1 when rank r's word arrives.
  std::vector<MPI_Request> listen(std::vector<int64_t>& heard) {
    say();
    heard.assign(size_t(size), -1);
    std::vector<MPI_Request> reqs;
    if (comm == MPI_COMM_NULL) return reqs;
    for (int r = 0; r < size; ++r)
      if (r != rank) {
        reqs.emplace_back();
        MPI_Irecv(&heard[size_t(r)], 1, MPI_INT64_T, r, kAliveTag, comm, &reqs.back());
      }
    return reqs;
  }
};
Liveness g_live;

// The world's ranks' hosts, learned at start (make_mpi_world): [world rank] the lowest world
// rank on the same host. And whether host-first collectives are allowed (SIGMA_HOST_FIRST=0:
// every collective direct, the comparison the benchmarks make).
std::vector<int> g_world_host;
bool g_host_first = true;

template <class T> MPI_Datatype mpi_type();
template <> MPI_Datatype mpi_type<float>() { return MPI_FLOAT; }
template <> MPI_Datatype mpi_type<double>() { return MPI_DOUBLE; }

// `len` elements of T whose copies for successive ranks lie `stride` elements apart: one
// rank's chunk of a collective over more elements than an int counts.
struct Strided {
  MPI_Datatype type = MPI_DATATYPE_NULL;
  Strided(MPI_Datatype elem, size_t len, size_t stride) {
    MPI_Datatype block;
    MPI_Aint lb = 0, extent = 0;
    MPI_Type_get_extent(elem, &lb, &extent);
    MPI_Type_contiguous(int(len), elem, &block);
    MPI_Type_create_resized(block, 0, MPI_Aint(stride) * extent, &type);
    MPI_Type_commit(&type);
    MPI_Type_free(&block);
  }
  ~Strided() { MPI_Type_free(&type); }
};

class MpiCommunicator final : public Communicator, public PointToPoint {
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
    std::vector<int> host(static_cast<size_t>(size_), 0);
    for (int r = 0; r < size_ && !g_world_host.empty(); ++r)
      host[size_t(r)] = g_world_host[size_t(world_ranks_[size_t(r)])];
    plan_ = HostPlan(host, g_host_first);
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
  std::string host_layout() const override { return plan_.describe(); }

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

 protected:
  // Host memory (communicator.h's contract: the base stages device buffers).
  void do_all_reduce_sum(float* data, size_t n) override { sum_all(data, n); }
  void do_all_reduce_sum(double* data, size_t n) override { sum_all(data, n); }

  // Chunk by chunk: rank r's part of each chunk, R parts summed by tree_sum.
  void do_reduce_scatter_sum(float* out, const float* in, size_t n) override {
    if (plan_.sums_host_first()) {
      const std::vector<int64_t> c(static_cast<size_t>(size_), static_cast<int64_t>(n));
      return host_first_sum(out, in, c.data());
    }
    count_uniform(int64_t(n * sizeof(float)));
    const size_t chunk = std::min(n, max_message_elements());
    std::vector<float> parts(chunk * size_t(size_));
    std::vector<const float*> p(static_cast<size_t>(size_));
    for (size_t off = 0; off < n; off += chunk) {
      const size_t len = std::min(chunk, n - off);
      const Strided each(MPI_FLOAT, len, n);  // rank r's len elements at in + r * n + off
      MPI_Request req;
      MPI_Ialltoall(in + off, 1, each.type, parts.data(), int(len), MPI_FLOAT, comm_, &req);
      wait(req, "reduce_scatter_sum");
      for (int r = 0; r < size_; ++r) p[size_t(r)] = parts.data() + size_t(r) * len;
      tree_sum(out + off, p.data(), size_, int64_t(len));
    }
  }

  void do_all_gather(float* out, const float* in, size_t n) override { gather(out, in, n); }
  void do_all_gather(double* out, const double* in, size_t n) override { gather(out, in, n); }

  void do_all_gather_bytes(void* out, const void* in, size_t bytes) override {
    SIGMA_CHECK(bytes <= size_t(INT_MAX), "all_gather_bytes: {} bytes in one record", bytes);
    count_uniform(int64_t(bytes));
    MPI_Request req;
    MPI_Iallgather(in, int(bytes), MPI_BYTE, out, int(bytes), MPI_BYTE, comm_, &req);
    wait(req, "all_gather_bytes");
  }

  void do_all_gather_v(float* out, const float* in, const int64_t* counts) override {
    if (plan_.gathers_host_first()) return host_first_gather(out, in, counts);
    count_uniform(counts[rank_] * int64_t(sizeof(float)));
    // Every rank holds the same counts, so every rank takes the same path.
    int64_t total = 0, most = 0;
    for (int r = 0; r < size_; ++r) total += counts[r], most = std::max(most, counts[r]);
    if (total <= int64_t(max_message_elements())) {
      std::vector<int> c(static_cast<size_t>(size_)), displ(static_cast<size_t>(size_));
      for (int r = 0, at = 0; r < size_; at += c[size_t(r)], ++r) {
        c[size_t(r)] = int(counts[r]);
        displ[size_t(r)] = at;
      }
      MPI_Request req;
      MPI_Iallgatherv(in, c[size_t(rank_)], MPI_FLOAT, out, c.data(), displ.data(), MPI_FLOAT,
                      comm_, &req);
      wait(req, "all_gather_v");
      return;
    }
    std::vector<Piece> sends, recvs;
    int64_t at = 0;
    for (int r = 0; r < size_; at += counts[r], ++r) {
      if (r == rank_) {
        std::copy(in, in + counts[r], out + at);
        continue;
      }
      sends.push_back({const_cast<float*>(in), size_t(counts[rank_]), r});
      recvs.push_back({out + at, size_t(counts[r]), r});
    }
    exchange(sends, recvs, "all_gather_v");
  }

  // Point-to-point: each pair knows its own counts, so no rank needs another's to agree on a
  // path, and a piece longer than an int goes in several messages.
  void do_all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                       const int64_t* recv_counts) override {
    std::vector<Piece> sends, recvs;
    pieces_all_to_all(send, send_counts, recv, recv_counts, sends, recvs);
    exchange(sends, recvs, "all_to_all_v");
  }

  // Non-blocking: point-to-point requests on a tag of their own, counted as a call when
  // started (every rank starts them in the same order, so the call numbers a timeout reports
  // agree across ranks).
  std::unique_ptr<PendingOp> do_start_all_to_all_v(const float* send, const int64_t* send_counts,
                                                   float* recv,
                                                   const int64_t* recv_counts) override {
    std::vector<Piece> sends, recvs;
    pieces_all_to_all(send, send_counts, recv, recv_counts, sends, recvs);
    ++calls_;
    return std::make_unique<Pending>(*this, post(sends, recvs, kOverlapTag), "start_all_to_all_v");
  }

  std::unique_ptr<PendingOp> do_start_all_gather_v(float* out, const float* in,
                                                   const int64_t* counts) override {
    if (plan_.gathers_host_first()) {
      const int64_t seq = start_host_first();
      return counted(std::make_unique<HostFirstGather<float>>(
          *this, plan_, rank_, out, in, counts, host_first_tag(seq, 0), host_first_tag(seq, 1)));
    }
    count_uniform(counts[rank_] * int64_t(sizeof(float)));
    std::vector<Piece> sends, recvs;
    int64_t at = 0;
    for (int r = 0; r < size_; at += counts[r], ++r) {
      if (r == rank_) {
        std::copy(in, in + counts[r], out + at);
        continue;
      }
      sends.push_back({const_cast<float*>(in), size_t(counts[rank_]), r});
      recvs.push_back({out + at, size_t(counts[r]), r});
    }
    ++calls_;
    return std::make_unique<Pending>(*this, post(sends, recvs, kOverlapTag), "start_all_gather_v");
  }

  // Host-first where the plan says so; otherwise the base's exchange and tree_sum (direct).
  void do_reduce_scatter_sum_v(float* out, const float* in, const int64_t* counts) override {
    if (plan_.sums_host_first()) return host_first_sum(out, in, counts);
    Communicator::do_reduce_scatter_sum_v(out, in, counts);
  }

  std::unique_ptr<PendingOp> do_start_reduce_scatter_sum_v(float* out, const float* in,
                                                           const int64_t* counts) override {
    if (!plan_.sums_host_first()) return Communicator::do_start_reduce_scatter_sum_v(out, in, counts);
    const int64_t seq = start_host_first();
    return counted(std::make_unique<HostFirstReduce<float>>(
        *this, plan_, rank_, out, in, counts, host_first_tag(seq, 0), host_first_tag(seq, 1)));
  }

  // The host-first collectives' messages (PointToPoint): point-to-point, completed on this
  // communicator's timeout.
  std::unique_ptr<Messages> post(const std::vector<Transfer>& sends,
                                 const std::vector<Transfer>& recvs, size_t elem_bytes,
                                 int tag) override {
    const MPI_Datatype type = elem_bytes == sizeof(double) ? MPI_DOUBLE : MPI_FLOAT;
    return std::make_unique<MpiMessages>(*this, post(sends, recvs, tag, type));
  }

  void do_broadcast(void* data, size_t bytes, int root) override {
    count_uniform(rank_ == root ? int64_t(bytes) : 0);
    char* p = static_cast<char*>(data);
    const size_t chunk = max_message_elements();
    for (size_t off = 0; off < bytes || off == 0; off += chunk) {
      MPI_Request req;
      MPI_Ibcast(p + off, int(std::min(chunk, bytes - off)), MPI_BYTE, root, comm_, &req);
      wait(req, "broadcast");
      if (bytes == 0) break;
    }
  }

 private:
  using Piece = Transfer;

  // A blocking host-first sum or gather (two rounds of messages on tags of their own).
  template <class T>
  void host_first_sum(T* out, const T* in, const int64_t* counts) {
    HostFirstReduce<T> op(*this, plan_, rank_, out, in, counts, kHostFirstBlockingTag,
                          kHostFirstBlockingTag + 1);
    count(op.bytes_to());
    op.wait();
    ++calls_;
  }
  template <class T>
  void host_first_gather(T* out, const T* in, const int64_t* counts) {
    HostFirstGather<T> op(*this, plan_, rank_, out, in, counts, kHostFirstBlockingTag,
                          kHostFirstBlockingTag + 1);
    count(op.bytes_to());
    op.wait();
    ++calls_;
  }

  // A non-blocking host-first op: its number on this communicator (its tags), counted in flight
  // until it completes (the tags repeat after kHostFirstOpsInFlight ops).
  int64_t start_host_first() {
    SIGMA_CHECK(live_ < kHostFirstOpsInFlight, "{} host-first collectives in flight on one "
                "communicator: complete some first", live_);
    ++live_;
    ++calls_;
    return started_++;
  }
  template <class Op>
  std::unique_ptr<PendingOp> counted(std::unique_ptr<Op> op) {
    count(op->bytes_to());
    return std::make_unique<CountedOp>(std::move(op), live_);
  }

  template <class T>
  void gather(T* out, const T* in, size_t n) {
    if (plan_.gathers_host_first()) {
      const std::vector<int64_t> c(static_cast<size_t>(size_), static_cast<int64_t>(n));
      return host_first_gather(out, in, c.data());
    }
    count_uniform(int64_t(n * sizeof(T)));
    if (n <= max_message_elements()) {
      MPI_Request req;
      MPI_Iallgather(in, int(n), mpi_type<T>(), out, int(n), mpi_type<T>(), comm_, &req);
      wait(req, "all_gather");
      return;
    }
    for (size_t off = 0; off < n; off += max_message_elements()) {
      const size_t len = std::min(max_message_elements(), n - off);
      const Strided each(mpi_type<T>(), len, n);  // rank r's chunk lands at out + r * n + off
      MPI_Request req;
      MPI_Iallgather(in + off, int(len), mpi_type<T>(), out + off, 1, each.type, comm_, &req);
      wait(req, "all_gather");
    }
  }

  // Reduce-scatter, then all-gather, one chunk of at most max_message_elements() at a time:
  // rank q owns piece q of R near-equal pieces of the chunk, receives every rank's part of it,
  // adds them by tree_sum in rank order and sends the sum back to all. The sums are those of
  // tree_sum over the whole vector's parts, so every rank gets the same bits as when each
  // gathered all parts and added them itself (the way before), but each rank sends and adds
  // 1/R of the data per phase: 2(R-1)/R of the vector leaves a rank, not R-1 copies of it,
  // and the temporary is one piece's R parts.
  template <class T>
  void sum_all(T* data, size_t n) {
    const size_t R = size_t(size_), me = size_t(rank_);
    const size_t chunk = std::min(n, max_message_elements());
    std::vector<T> parts(R * (chunk / R + 1));
    std::vector<const T*> p(R);
    std::vector<int> piece(R), start(R), mine(R), at(R);
    std::vector<int64_t> bytes(R, 0);
    for (size_t off = 0; off < n; off += chunk) {
      const size_t len = std::min(chunk, n - off);
      for (size_t q = 0; q < R; ++q) {
        start[q] = int(len * q / R);
        piece[q] = int(len * (q + 1) / R) - start[q];
      }
      const int own = piece[me];
      T* x = data + off;
      if (plan_.sums_host_first()) {  // the same pieces and sums, each host's parts added first
        const std::vector<int64_t> c(piece.begin(), piece.end());
        host_first_sum(x + start[me], x, c.data());
        host_first_gather(x, x + start[me], c.data());
        continue;
      }
      for (size_t q = 0; q < R; ++q) {
        mine[q] = own;
        at[q] = int(q) * own;
        bytes[q] += int64_t(piece[q] + own) * int64_t(sizeof(T));  // its piece, then my sum
      }
      MPI_Request req;
      MPI_Ialltoallv(x, piece.data(), start.data(), mpi_type<T>(), parts.data(), mine.data(),
                     at.data(), mpi_type<T>(), comm_, &req);
      wait(req, "all_reduce_sum");
      for (size_t q = 0; q < R; ++q) p[q] = parts.data() + size_t(at[q]);
      tree_sum(x + start[me], p.data(), size_, int64_t(own));
      MPI_Iallgatherv(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, x, piece.data(), start.data(),
                      mpi_type<T>(), comm_, &req);
      wait(req, "all_reduce_sum");
    }
    if (!plan_.sums_host_first()) count(bytes);
  }

  // Point-to-point requests in flight and the rank each one waits for.
  struct Posted {
    std::vector<MPI_Request> reqs;
    std::vector<int> peer_of;
  };

  // Sends and receives pieces in messages of at most max_message_elements(); messages between
  // two ranks on one tag arrive in order, so each piece is reassembled in place.
  Posted post(const std::vector<Piece>& sends, const std::vector<Piece>& recvs, int tag,
              MPI_Datatype type = MPI_FLOAT) {
    Posted p;
    const size_t chunk = max_message_elements();
    int elem = 0;
    MPI_Type_size(type, &elem);
    auto at = [&](const Piece& q, size_t off) { return static_cast<char*>(q.data) + off * size_t(elem); };
    for (const Piece& q : recvs)
      for (size_t off = 0; off < q.n; off += chunk) {
        p.reqs.emplace_back();
        p.peer_of.push_back(q.peer);
        MPI_Irecv(at(q, off), int(std::min(chunk, q.n - off)), type, q.peer, tag, comm_,
                  &p.reqs.back());
      }
    for (const Piece& q : sends)
      for (size_t off = 0; off < q.n; off += chunk) {
        p.reqs.emplace_back();
        p.peer_of.push_back(q.peer);
        MPI_Isend(at(q, off), int(std::min(chunk, q.n - off)), type, q.peer, tag, comm_,
                  &p.reqs.back());
      }
    return p;
  }

  // A host-first op's round of messages (Messages), completed on the timeout.
  class MpiMessages final : public Messages {
   public:
    MpiMessages(MpiCommunicator& c, Posted p) : c_(c), p_(std::move(p)) {}
    bool test() override {
      int all = 0;
      MPI_Testall(int(p_.reqs.size()), p_.reqs.data(), &all, MPI_STATUSES_IGNORE);
      return all != 0;
    }
    void wait() override { c_.complete(p_, "a host-first sum or gather"); }

   private:
    MpiCommunicator& c_;
    Posted p_;
  };

  void exchange(const std::vector<Piece>& sends, const std::vector<Piece>& recvs, const char* what) {
    Posted p = post(sends, recvs, kExchangeTag);
    complete(p, what);
    ++calls_;
  }

  // The pieces of an all_to_all_v (or, with the same piece sent to every peer, an
  // all_gather_v): `sends` and `recvs` point into the caller's buffers; the piece to and from
  // this rank itself is copied here.
  void pieces_all_to_all(const float* send, const int64_t* send_counts, float* recv,
                         const int64_t* recv_counts, std::vector<Piece>& sends,
                         std::vector<Piece>& recvs) {
    std::vector<int64_t> bytes(static_cast<size_t>(size_));
    int64_t s_at = 0, r_at = 0;
    for (int r = 0; r < size_; ++r) {
      SIGMA_CHECK(send_counts[r] >= 0 && recv_counts[r] >= 0, "all_to_all_v: negative count");
      bytes[size_t(r)] = send_counts[r] * int64_t(sizeof(float));
      if (r == rank_) {
        SIGMA_CHECK(send_counts[r] == recv_counts[r], "all_to_all_v: rank {} sends {} elements "
                    "to itself but expects {}", r, send_counts[r], recv_counts[r]);
        std::copy(send + s_at, send + s_at + send_counts[r], recv + r_at);
      } else {
        sends.push_back({const_cast<float*>(send + s_at), size_t(send_counts[r]), r});
        recvs.push_back({recv + r_at, size_t(recv_counts[r]), r});
      }
      s_at += send_counts[r];
      r_at += recv_counts[r];
    }
    count(bytes);
  }

  // A non-blocking exchange: its requests, completed by test() or wait() on the owner's
  // timeout (an op must not outlive its communicator).
  class Pending final : public PendingOp {
   public:
    Pending(MpiCommunicator& c, Posted p, const char* what) : c_(c), p_(std::move(p)), what_(what) {}
    ~Pending() override {
      if (!done_ && std::uncaught_exceptions() == 0) wait();
    }
    bool test() override {
      if (!done_) {
        int all = 0;
        MPI_Testall(int(p_.reqs.size()), p_.reqs.data(), &all, MPI_STATUSES_IGNORE);
        done_ = all != 0;
      }
      return done_;
    }
    void wait() override {
      if (done_) return;
      c_.complete(p_, what_);
      done_ = true;
    }

   private:
    MpiCommunicator& c_;
    Posted p_;
    const char* what_;
    bool done_ = false;
  };

  // Polls the requests until all are complete; past the timeout, names the silent peers and
  // aborts the run.
  void complete(Posted& posted, const char* what) {
    std::vector<MPI_Request>& reqs = posted.reqs;
    const std::vector<int>& peer_of = posted.peer_of;
    const auto start = Clock::now();
    int polls = 0;
    auto nap = std::chrono::microseconds(20);
    while (true) {
      int done = 0;
      MPI_Testall(int(reqs.size()), reqs.data(), &done, MPI_STATUSES_IGNORE);
      if (done) break;
      if (++polls < 200) continue;
      g_live.serve();
      if (timed_out(start)) {  // the ranks that neither sent to us nor took what we sent
        std::vector<int> silent;
        for (size_t i = 0; i < reqs.size(); ++i) {
          int got = 0;
          MPI_Test(&reqs[i], &got, MPI_STATUS_IGNORE);
          if (!got && std::find(silent.begin(), silent.end(), peer_of[i]) == silent.end())
            silent.push_back(peer_of[i]);
        }
        std::sort(silent.begin(), silent.end());
        give_up(what, start, peers_after_timeout(&silent));
      }
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
  }

  using Clock = std::chrono::steady_clock;

  bool timed_out(Clock::time_point start) const {
    return timeout_s_ > 0 && std::chrono::duration<double>(Clock::now() - start).count() > timeout_s_;
  }

  // Polls until `req` completes; past the timeout, finds who never entered and aborts the run.
  void wait(MPI_Request& req, const char* what) {
    const auto start = Clock::now();
    int done = 0, polls = 0;
    auto nap = std::chrono::microseconds(20);
    while (true) {
      MPI_Test(&req, &done, MPI_STATUS_IGNORE);
      if (done) break;
      if (++polls < 200) continue;
      g_live.serve();
      if (timed_out(start)) give_up(what, start, peers_after_timeout(nullptr));
      std::this_thread::sleep_for(nap);
      nap = std::min(nap * 2, std::chrono::microseconds(1000));
    }
    ++calls_;
  }

  struct Verdict {
    std::vector<int> missing;  // this communicator's ranks that never entered (its numbering)
    std::vector<int> alive;    // world ranks heard from after the timeout, this one included
    double grace = 0;
  };

  // After a timeout in a collective: every rank stuck in it announces so to the others; the
  // ranks not heard from within a grace period never entered it (or hang inside it); `silent`
  // gives them instead where the caller knows (the point-to-point exchange). At the same time
  // the world's liveness round (Liveness) finds which ranks are reachable at all.
  Verdict peers_after_timeout(const std::vector<int>* silent) {
    Verdict v;
    // Members: the run aborts with these messages possibly still in flight.
    announce_ = calls_;
    const int64_t me = announce_;
    std::vector<int64_t>& heard = heard_;
    heard.assign(static_cast<size_t>(size_), -1);
    std::vector<MPI_Request> reqs;
    for (int r = 0; r < size_ && !silent; ++r) {
      if (r == rank_) continue;
      reqs.emplace_back();
      MPI_Isend(&announce_, 1, MPI_INT64_T, r, kWaitingTag, comm_, &reqs.back());
      reqs.emplace_back();
      MPI_Irecv(&heard[size_t(r)], 1, MPI_INT64_T, r, kWaitingTag, comm_, &reqs.back());
    }
    std::vector<MPI_Request> world = g_live.listen(world_heard_);
    // Ranks that entered later time out later, and a rank busy computing answers only when it
    // next waits: a grace of up to 2 s, so that every rank ends within dist.timeout_s + 5 s.
    v.grace = std::min(timeout_s_, 2.0);
    const auto grace = Clock::now() + std::chrono::duration<double>(v.grace);
    while (Clock::now() < grace) {
      int a = 0, b = 0;
      MPI_Testall(int(reqs.size()), reqs.data(), &a, MPI_STATUSES_IGNORE);
      MPI_Testall(int(world.size()), world.data(), &b, MPI_STATUSES_IGNORE);
      if (a && b) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    for (size_t i = 1; i < reqs.size(); i += 2) {  // the receives
      int got = 0;
      MPI_Test(&reqs[i], &got, MPI_STATUS_IGNORE);
    }
    for (MPI_Request& q : world) {
      int got = 0;
      MPI_Test(&q, &got, MPI_STATUS_IGNORE);
    }
    if (silent) {
      v.missing = *silent;
    } else {
      for (int r = 0; r < size_; ++r)
        if (r != rank_ && heard[size_t(r)] != me) v.missing.push_back(r);
    }
    for (int r = 0; r < g_live.size; ++r)
      if (r == g_live.rank || world_heard_[size_t(r)] != -1) v.alive.push_back(r);
    return v;
  }

  // The hosts all of whose ranks are lost (not alive), as "host h1 (ranks 2-3)".
  static std::vector<std::string> lost_hosts(const std::vector<int>& alive) {
    std::vector<std::string> out;
    const std::vector<std::string>& host = g_live.hosts;
    if (host.size() != size_t(g_live.size)) return out;
    std::vector<std::string> seen;
    for (int r = 0; r < g_live.size; ++r) {
      const std::string& h = host[size_t(r)];
      if (std::find(seen.begin(), seen.end(), h) != seen.end()) continue;
      seen.push_back(h);
      std::vector<int> ranks;
      bool any_alive = false;
      for (int q = 0; q < g_live.size; ++q)
        if (host[size_t(q)] == h) {
          ranks.push_back(q);
          any_alive = any_alive || std::binary_search(alive.begin(), alive.end(), q);
        }
      if (!any_alive)
        out.push_back(fmt::format("host {} (rank{} {})", h, ranks.size() > 1 ? "s" : "", rank_list(ranks)));
    }
    return out;
  }

  // One line, printed by the lowest world rank still alive, then MPI_Abort. Where Open MPI
  // cannot end the run (its daemon on a lost host is unreachable, and the abort may wait for
  // it), the rank ends itself a second later.
  [[noreturn]] void give_up(const char* what, Clock::time_point start, const Verdict& v) {
    const int me = g_live.rank;
    const double waited = std::chrono::duration<double>(Clock::now() - start).count() - v.grace;
    const std::vector<std::string> lost = lost_hosts(v.alive);
    if (v.alive.front() == me) {
      std::string line;
      if (!lost.empty()) {
        line = fmt::format("sigma: error: lost {}: no word from {} within {:.0f} s after rank {} "
                           "waited {:.0f} s in {} (call {} on a communicator of {} ranks): the "
                           "host died or its link is down (dist.timeout_s = {}); aborting the "
                           "run; resume from the last checkpoint on the hosts that remain\n",
                           fmt::join(lost, ", "), lost.size() > 1 ? "their ranks" : "its ranks",
                           v.grace, me, waited, what, calls_ + 1, size_, timeout_s_);
      } else {
        std::vector<int> world_missing, waiting;
        for (int r : v.missing) world_missing.push_back(world_rank(r));
        for (int r = 0; r < size_; ++r)
          if (std::find(v.missing.begin(), v.missing.end(), r) == v.missing.end())
            waiting.push_back(world_rank(r));
        const std::string who =
            world_missing.empty()
                ? fmt::format("every one of its {} ranks entered it, but it did not finish", size_)
                : fmt::format("rank{} {} never entered it (waiting: rank{} {})",
                              world_missing.size() > 1 ? "s" : "", fmt::join(world_missing, ", "),
                              waiting.size() > 1 ? "s" : "", fmt::join(waiting, ", "));
        line = fmt::format("sigma: error: rank {} waited {:.0f} s in {} (call {} on a communicator "
                           "of {} ranks): {}; a rank died or hangs (dist.timeout_s = {}); aborting "
                           "the run\n", me, waited, what, calls_ + 1, size_, who, timeout_s_);
      }
      std::fputs(line.c_str(), stderr);
      std::fflush(stderr);
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the printer's line first
    }
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::seconds(1));
      std::_Exit(3);
    }).detach();
    MPI_Abort(MPI_COMM_WORLD, 3);
    std::_Exit(3);
  }

  MPI_Comm comm_;
  int rank_ = 0, size_ = 1;
  double timeout_s_;
  bool world_;
  int64_t calls_ = 0;  // calls completed on this communicator (the same on every member)
  int64_t announce_ = 0;       // after a timeout: the call this rank waits in
  std::vector<int64_t> heard_;  // and the one each other rank said it waits in
  std::vector<int64_t> world_heard_;  // after a timeout: which world ranks said they are alive
  std::vector<int> world_ranks_;
  HostPlan plan_;  // where this communicator's ranks live (host-first sums and gathers)
  int64_t started_ = 0, live_ = 0;  // non-blocking host-first ops started, and in flight
};

}  // namespace

namespace {
// Which world ranks share a host: MPI_Comm_split_type's shared-memory groups (what Open MPI
// knows of its nodes), each named by its lowest world rank. SIGMA_TEST_HOSTS (a host id per
// world rank, "0,0,1,1") stands in for them in tests that fake hosts on one machine.
void learn_hosts() {
  const int me = g_live.rank, R = g_live.size;
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, me, MPI_INFO_NULL, &local);
  int lowest = me;
  MPI_Allreduce(&me, &lowest, 1, MPI_INT, MPI_MIN, local);
  MPI_Comm_free(&local);
  g_world_host.assign(size_t(R), 0);
  MPI_Allgather(&lowest, 1, MPI_INT, g_world_host.data(), 1, MPI_INT, MPI_COMM_WORLD);
  if (const char* fake = std::getenv("SIGMA_TEST_HOSTS")) {
    std::vector<int> ids;
    for (const char* p = fake; *p;) {
      char* end = nullptr;
      ids.push_back(int(std::strtol(p, &end, 10)));
      SIGMA_CHECK(end != p, "SIGMA_TEST_HOSTS = '{}': a host id per world rank, e.g. 0,0,1,1", fake);
      p = *end == ',' ? end + 1 : end;
    }
    SIGMA_CHECK(ids.size() == size_t(R), "SIGMA_TEST_HOSTS = '{}' names {} ranks' hosts; the world "
                "has {}", fake, ids.size(), R);
    g_world_host = ids;
  }
  const char* allow = std::getenv("SIGMA_HOST_FIRST");
  g_host_first = !(allow && std::string(allow) == "0");
}
}  // namespace

std::unique_ptr<Communicator> make_mpi_world(double timeout_s) {
  int ready = 0;
  MPI_Initialized(&ready);
  if (!ready) {
    int provided = 0;
    MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
  }
  if (g_live.comm == MPI_COMM_NULL) {  // the liveness round's communicator and host names
    MPI_Comm_dup(MPI_COMM_WORLD, &g_live.comm);
    MPI_Comm_set_errhandler(g_live.comm, MPI_ERRORS_RETURN);  // a lost peer is no error here
    MPI_Comm_rank(MPI_COMM_WORLD, &g_live.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_live.size);
    constexpr int kName = 256;
    char mine[kName] = {};
    ::gethostname(mine, kName - 1);
    std::vector<char> all(size_t(kName) * size_t(g_live.size));
    MPI_Allgather(mine, kName, MPI_CHAR, all.data(), kName, MPI_CHAR, MPI_COMM_WORLD);
    for (int r = 0; r < g_live.size; ++r) g_live.hosts.emplace_back(all.data() + size_t(r) * kName);
    learn_hosts();
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
