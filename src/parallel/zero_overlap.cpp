#include "parallel/zero_overlap.h"

#include <algorithm>
#include <chrono>

#include "core/error.h"
#include "core/uninit_vector.h"
#include "parallel/owner_streams.h"

namespace sigma {

// One bucketed round in flight: owner o's slice [b, e) of round k of `streams`, for every o.
struct ZeroOverlap::Round {
  bool reduce = true;
  int key = 0;
  std::shared_ptr<const zero_detail::OwnerStreams> streams;
  size_t k = 0, S = 0;
  size_t elements = 0;  // this rank's buffers
  size_t counted = 0;   // as the bound counts them: alike on every rank
  bool taken = false;   // complete and taken in (by progress() or a wait)
  UninitVector<float> send, recv;  // reduce: recv is the sum of my slice (both filled whole)
  std::vector<int64_t> send_counts;
  std::unique_ptr<PendingOp> op;
};

namespace {
using OverlapClock = std::chrono::steady_clock;
double overlap_seconds_since(OverlapClock::time_point t) {
  return std::chrono::duration<double>(OverlapClock::now() - t).count();
}
}  // namespace

ZeroOverlap::ZeroOverlap(Communicator& comm, const ShardPlan& plan, ParamSet& ps, size_t bucket,
                         size_t max_in_flight)
    : comm_(comm), plan_(plan), ps_(ps), bucket_(bucket), max_in_flight_(max_in_flight) {
  SIGMA_CHECK(plan.ranks == comm.size(), "shard plan for {} ranks used with {}", plan.ranks,
              comm.size());
  SIGMA_CHECK(bucket >= 1 && max_in_flight >= 1, "ZeroOverlap: bucket {} and bound {} elements",
              bucket, max_in_flight);
}

ZeroOverlap::~ZeroOverlap() = default;  // a Round's PendingOp waits for itself

void ZeroOverlap::launch(std::unique_ptr<Round> r, size_t counted) {
  // A reduce round holds the R parts of its slice inside the communicator until it is summed.
  r->elements = r->send.size() + r->recv.size() * (r->reduce ? size_t(comm_.size()) : 1);
  r->counted = counted;
  counted_ += counted;
  if (r->reduce) {
    r->op = comm_.start_reduce_scatter_sum_v(r->recv.data(), r->send.data(),
                                             r->send_counts.data());
  } else {
    r->op = comm_.start_all_gather_v(r->recv.data(), r->send.data(), r->send_counts.data());
  }
  in_flight_ += r->elements;
  peak_in_flight_ = std::max(peak_in_flight_, in_flight_);
  rounds_.push_back(std::move(r));
}

void ZeroOverlap::take_in(Round& r) {
  const int R = comm_.size(), me = comm_.rank();
  const zero_detail::OwnerStreams& st = *r.streams;
  if (r.reduce) {  // the op added the R parts of my slice (tree_sum in rank order)
    const auto [b, e] = st.slice(me, r.k, r.S);
    st.unpack(me, b, e, r.recv.data());
  } else {
    const float* at = r.recv.data();
    for (int o = 0; o < R; ++o) {
      const auto [ob, oe] = st.slice(o, r.k, r.S);
      if (o != me) st.unpack(o, ob, oe, at);
      at += oe - ob;
    }
  }
  in_flight_ -= r.elements;
  r.send = {};
  r.recv = {};
  r.taken = true;
}

// The bound's count of a round of S-element slices: what the rank with the largest slice
// holds (the same figure on every rank). all: the elements of every owner's slice.
size_t ZeroOverlap::counted_size(const zero_detail::OwnerStreams& st, size_t k, size_t S,
                                 bool reduce) const {
  const int R = comm_.size();
  size_t all = 0, most = 0;
  for (int o = 0; o < R; ++o) {
    const auto [b, e] = st.slice(o, k, S);
    all += e - b;
    most = std::max(most, e - b);
  }
  return reduce ? all + size_t(R) * most : all + most;
}

void ZeroOverlap::make_room(size_t counted) {
  while (!rounds_.empty() && counted_ + counted > max_in_flight_) complete(3, 0);
}

void ZeroOverlap::start_reduce(const ParamStage& pieces) {
  const int R = comm_.size(), me = comm_.rank();
  if (R == 1 || pieces.empty()) return;
  auto st = std::make_shared<const zero_detail::OwnerStreams>(plan_, ps_.all(), true, &pieces);
  const size_t S = st->slice_elements(bucket_);
  for (size_t k = 0, rounds = st->rounds(S); k < rounds; ++k) {
    auto r = std::make_unique<Round>();
    r->reduce = true, r->streams = st, r->k = k, r->S = S;
    size_t out = 0;
    for (int o = 0; o < R; ++o) {
      const auto [b, e] = st->slice(o, k, S);
      out += e - b;
    }
    const auto [b, e] = st->slice(me, k, S);
    const size_t counted = counted_size(*st, k, S, true);
    make_room(counted);  // before allocating this round's buffers
    r->send.resize(out);
    r->send_counts.resize(size_t(R));
    float* at = r->send.data();
    for (int o = 0; o < R; ++o) {
      const auto [ob, oe] = st->slice(o, k, S);
      st->pack(o, ob, oe, at);
      at += oe - ob;
      r->send_counts[size_t(o)] = int64_t(oe - ob);
    }
    r->recv.resize(e - b);
    launch(std::move(r), counted);
  }
}

void ZeroOverlap::start_gather(const ParamStage& pieces, int key) {
  const int R = comm_.size(), me = comm_.rank();
  if (R == 1 || pieces.empty()) return;
  auto st = std::make_shared<const zero_detail::OwnerStreams>(plan_, ps_.all(), false, &pieces);
  const size_t S = st->slice_elements(bucket_);
  for (size_t k = 0, rounds = st->rounds(S); k < rounds; ++k) {
    auto r = std::make_unique<Round>();
    r->reduce = false, r->key = key, r->streams = st, r->k = k, r->S = S;
    r->send_counts.resize(size_t(R));
    size_t all = 0;
    for (int o = 0; o < R; ++o) {
      const auto [b, e] = st->slice(o, k, S);
      r->send_counts[size_t(o)] = int64_t(e - b);
      all += e - b;
    }
    const auto [b, e] = st->slice(me, k, S);
    const size_t counted = counted_size(*st, k, S, false);
    make_room(counted);
    r->send.resize(e - b);
    st->pack(me, b, e, r->send.data());
    r->recv.resize(all);
    launch(std::move(r), counted);
  }
}

void ZeroOverlap::progress() {  // takes in, but retires nothing: only waits every rank makes do
  for (auto& r : rounds_)
    if (!r->taken && r->op->test()) take_in(*r);
}

// Completes (waits for and takes in) the rounds in flight that `which` selects: 0 reduce
// rounds, 1 gather rounds of `key`, 2 every gather round, 3 the oldest round alone.
void ZeroOverlap::complete(int which, int key) {
  const auto t = OverlapClock::now();
  for (auto it = rounds_.begin(); it != rounds_.end();) {
    Round& r = **it;
    const bool pick = which == 3 || (which == 0 && r.reduce) ||
                      (which == 1 && !r.reduce && r.key == key) || (which == 2 && !r.reduce);
    if (!pick) {
      ++it;
      continue;
    }
    if (!r.taken) {
      r.op->wait();
      take_in(r);
    }
    counted_ -= r.counted;
    it = rounds_.erase(it);
    if (which == 3) break;
  }
  blocked_s_ += overlap_seconds_since(t);
}

void ZeroOverlap::finish_reduce() { complete(0, 0); }
void ZeroOverlap::finish_gather(int key) { complete(1, key); }
void ZeroOverlap::finish_gathers() { complete(2, 0); }

bool ZeroOverlap::gathers_pending() const {
  for (const auto& r : rounds_)
    if (!r->reduce && !r->taken) return true;
  return false;
}

}  // namespace sigma
