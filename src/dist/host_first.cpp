#include "dist/host_first.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstring>
#include <exception>

#include "core/error.h"
#include "dist/rank_list.h"

namespace sigma {

namespace {

// Appends the maximal nodes of tree_sum's tree over ranks [lo, hi) whose ranks share a host.
void host_blocks(const std::vector<int>& host, int lo, int hi, std::vector<HostPlan::Block>& out) {
  if (std::all_of(host.begin() + lo, host.begin() + hi, [&](int h) { return h == host[size_t(lo)]; })) {
    out.push_back({lo, hi});
    return;
  }
  int left = 1;  // as tree_sum splits: the largest power of two below the count
  while (left * 2 < hi - lo) left *= 2;
  host_blocks(host, lo, lo + left, out);
  host_blocks(host, lo + left, hi, out);
}

}  // namespace

HostPlan::HostPlan(const std::vector<int>& host_of_rank, bool allow) : allow_(allow) {
  std::vector<int> ids;  // the given ids, in order of first rank
  for (int id : host_of_rank) {
    auto it = std::find(ids.begin(), ids.end(), id);
    if (it == ids.end()) {
      ids.push_back(id);
      members_.emplace_back();
      it = ids.end() - 1;
    }
    const int h = int(it - ids.begin());
    members_[size_t(h)].push_back(int(host_.size()));
    host_.push_back(h);
  }
  if (host_.empty()) return;
  host_blocks(host_, 0, size(), blocks_);
  block_of_.resize(host_.size());
  bool pairs = false;
  for (size_t b = 0; b < blocks_.size(); ++b) {
    for (int r = blocks_[b].lo; r < blocks_[b].hi; ++r) block_of_[size_t(r)] = int(b);
    pairs = pairs || blocks_[b].hi - blocks_[b].lo >= 2;
  }
  const bool crowded = std::any_of(members_.begin(), members_.end(),
                                   [](const std::vector<int>& m) { return m.size() >= 2; });
  sums_ = allow_ && hosts() >= 2 && pairs;
  gathers_ = allow_ && hosts() >= 2 && crowded;
}

int HostPlan::reducer(int block, int owner) const {
  const Block& b = blocks_[size_t(block)];
  if (owner >= b.lo && owner < b.hi) return owner;
  return b.lo + owner % (b.hi - b.lo);
}

int HostPlan::gateway(int host, int source) const {
  const std::vector<int>& m = members_[size_t(host)];
  return m[size_t(source) % m.size()];
}

HostPlan::Cross HostPlan::reduce_cross() const {
  Cross c;
  const double P = size();
  for (int h = 0; h < hosts(); ++h) {
    const double n = double(members(h).size()), away = P - n;  // the owners on other hosts
    int blocks = 0;
    for (const Block& b : blocks_) blocks += host_of(b.lo) == h;
    c.direct = std::max(c.direct, n * away / P);
    c.host_first = std::max(c.host_first, (sums_ ? blocks : n) * away / P);
    c.aligned = std::max(c.aligned, away / P);
  }
  return c;
}

HostPlan::Cross HostPlan::gather_cross() const {
  Cross c;
  const double P = size();
  for (int h = 0; h < hosts(); ++h) {
    const double n = double(members(h).size());
    c.direct = std::max(c.direct, n * (P - n) / P);
    c.host_first = std::max(c.host_first, n * (gathers_ ? hosts() - 1 : P - n) / P);
    c.aligned = std::max(c.aligned, n * (hosts() - 1) / P);
  }
  return c;
}

std::string HostPlan::describe() const {
  if (hosts() < 2) return {};
  std::vector<std::string> where;
  for (int h = 0; h < hosts(); ++h) where.push_back(rank_list(members(h)));
  const Cross s = reduce_cross(), g = gather_cross();
  if (hosts() == size())
    return fmt::format("{} ranks on {} hosts, one on each: nothing to add or gather inside a host, "
                       "so sums and gathers go direct, {:.2f} of the vector out of each host per "
                       "reduce-scatter and {:.2f} per all-gather", size(), hosts(), s.direct, g.direct);
  std::string sums, gathers;
  if (sums_) {
    sums = fmt::format("sums host-first (each host adds its ranks' parts, then sends its partial "
                       "sums): {:.2f} of the vector out of the busiest host per reduce-scatter, "
                       "direct would send {:.2f}", s.host_first, s.direct);
  } else if (!allow_) {
    sums = fmt::format("sums direct (SIGMA_HOST_FIRST=0): {:.2f} of the vector out of the busiest "
                       "host per reduce-scatter, host-first would send {:.2f}", s.direct,
                       HostPlan(host_, true).reduce_cross().host_first);
  } else {
    sums = fmt::format("sums direct: no host holds two ranks that tree_sum adds first (rank "
                       "order), so host-first would send as much, {:.2f} of the vector out of "
                       "the busiest host per reduce-scatter; hosts holding aligned power-of-two "
                       "blocks of ranks (slots a power of two, mpirun --map-by slot) would send "
                       "{:.2f}", s.direct, s.aligned);
  }
  if (gathers_) {
    gathers = fmt::format("gathers host-first: {:.2f} per all-gather (direct {:.2f})", g.host_first,
                          g.direct);
  } else {
    gathers = fmt::format("gathers direct: {:.2f} per all-gather", g.direct);
  }
  return fmt::format("{} ranks on {} hosts (ranks {}): {}; {}", size(), hosts(),
                     fmt::join(where, " | "), sums, gathers);
}

namespace {

// tree_sum over parts [lo, hi) where some subtrees are added already: node(lo, hi) is the sum
// of parts [lo, hi) when the caller holds it (a block's partial sum, a lone part), else null,
// and a node without one is split as tree_sum splits it. The same additions in the same order
// as tree_sum over the parts. `out` may be one of the nodes (it is then read before written).
template <class T, class Node>
void tree_sum_nodes(T* out, int lo, int hi, int64_t n, const Node& node) {
  if (const T* p = node(lo, hi)) {
    if (out != p) std::memmove(out, p, size_t(n) * sizeof(T));
    return;
  }
  SIGMA_CHECK(hi - lo >= 2, "host-first sum: rank {} has no part", lo);
  int left = 1;
  while (left * 2 < hi - lo) left *= 2;
  if (hi - lo == 2 && node(lo, lo + 1) && node(lo + 1, hi)) {
    const T *a = node(lo, lo + 1), *b = node(lo + 1, hi);
    for (int64_t i = 0; i < n; ++i) out[i] = a[i] + b[i];
    return;
  }
  std::vector<T> right(static_cast<size_t>(n));
  tree_sum_nodes(right.data(), lo + left, hi, n, node);
  tree_sum_nodes(out, lo, lo + left, n, node);
  for (int64_t i = 0; i < n; ++i) out[i] += right[size_t(i)];
}

std::vector<int64_t> host_first_offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> at(counts.size(), 0);
  for (size_t r = 1; r < counts.size(); ++r) at[r] = at[r - 1] + counts[r - 1];
  return at;
}

}  // namespace

template <class T>
HostFirstReduce<T>::HostFirstReduce(PointToPoint& net, const HostPlan& plan, int me, T* out,
                                    const T* in, const int64_t* counts, int tag1, int tag2)
    : net_(net), plan_(plan), me_(me), block_(plan.block_of(me)), out_(out), in_(in),
      counts_(counts, counts + plan.size()), at_(host_first_offsets(counts_)), tag2_(tag2) {
  const int P = plan.size();
  const HostPlan::Block b = plan.blocks()[size_t(block_)];
  bytes_to_.assign(size_t(P), 0);
  std::vector<Transfer> sends, recvs;
  for (int o = 0; o < P; ++o) {
    SIGMA_CHECK(counts_[size_t(o)] >= 0, "host-first reduce: {} elements for rank {}",
                counts_[size_t(o)], o);
    const int x = plan.reducer(block_, o);
    if (x == me) {
      mine_.push_back(o);
    } else if (counts_[size_t(o)] > 0) {
      sends.push_back({const_cast<T*>(in + at_[size_t(o)]), size_t(counts_[size_t(o)]), x});
      bytes_to_[size_t(x)] += counts_[size_t(o)] * int64_t(sizeof(T));
    }
  }
  // The block's other ranks' parts for the owners this rank adds for.
  const size_t others = size_t(b.hi - b.lo - 1);
  parts_.resize(mine_.size());
  for (size_t i = 0; i < mine_.size(); ++i) {
    const size_t n = size_t(counts_[size_t(mine_[i])]);
    if (mine_[i] != me) bytes_to_[size_t(mine_[i])] += int64_t(n * sizeof(T));  // round 2
    if (n == 0 || others == 0) continue;
    parts_[i].resize(others * n);
    size_t k = 0;
    for (int m = b.lo; m < b.hi; ++m)
      if (m != me) recvs.push_back({parts_[i].data() + n * k++, n, m});
  }
  round1_ = net.post(sends, recvs, sizeof(T), tag1);
  // Round 2's receives: every other block's partial sum for me, from its reducer.
  std::vector<Transfer> from;
  received_.resize(plan.blocks().size());
  const size_t n = size_t(counts_[size_t(me)]);
  for (size_t k = 0; k < received_.size() && n > 0; ++k) {
    if (int(k) == block_) continue;
    received_[k].resize(n);
    from.push_back({received_[k].data(), n, plan.reducer(int(k), me)});
  }
  recv2_ = net.post({}, from, sizeof(T), tag2);
}

template <class T>
HostFirstReduce<T>::~HostFirstReduce() {
  if (state_ != 2 && std::uncaught_exceptions() == 0) wait();
}

template <class T>
void HostFirstReduce<T>::add_block() {
  const HostPlan::Block b = plan_.blocks()[size_t(block_)];
  const int size = b.hi - b.lo;
  partial_.resize(mine_.size());
  std::vector<Transfer> sends;
  std::vector<const T*> p(static_cast<size_t>(size));
  for (size_t i = 0; i < mine_.size(); ++i) {
    const int o = mine_[i];
    const size_t n = size_t(counts_[size_t(o)]);
    const T* own = in_ + at_[size_t(o)];
    if (n == 0) continue;
    const T* sum = own;  // a lone rank's partial sum is its part
    if (size > 1) {
      for (int m = b.lo, k = 0; m < b.hi; ++m)
        p[size_t(m - b.lo)] = m == me_ ? own : parts_[i].data() + n * size_t(k++);
      partial_[i].resize(n);
      tree_sum(partial_[i].data(), p.data(), size, int64_t(n));
      parts_[i] = {};
      sum = partial_[i].data();
    }
    if (o != me_) sends.push_back({const_cast<T*>(sum), n, o});
  }
  send2_ = net_.post(sends, {}, sizeof(T), tag2_);
  state_ = 1;
}

template <class T>
void HostFirstReduce<T>::finish() {
  const int64_t n = counts_[size_t(me_)];
  state_ = 2;
  if (n == 0) return;
  const T* mine = in_ + at_[size_t(me_)];  // my block's partial sum for me
  for (size_t i = 0; i < mine_.size(); ++i)
    if (mine_[i] == me_ && !partial_[i].empty()) mine = partial_[i].data();
  const std::vector<HostPlan::Block>& blocks = plan_.blocks();
  tree_sum_nodes(out_, 0, plan_.size(), n, [&](int lo, int hi) -> const T* {
    const int k = plan_.block_of(lo);
    if (blocks[size_t(k)].lo != lo || blocks[size_t(k)].hi != hi) return nullptr;
    return k == block_ ? mine : received_[size_t(k)].data();
  });
  received_ = {};
  partial_ = {};
}

template <class T>
bool HostFirstReduce<T>::test() {
  if (state_ == 0) {
    if (!round1_->test()) return false;
    add_block();
  }
  if (state_ == 1) {
    const bool got = recv2_->test(), sent = send2_->test();
    if (!got || !sent) return false;
    finish();
  }
  return true;
}

template <class T>
void HostFirstReduce<T>::wait() {
  if (state_ == 0) {
    round1_->wait();
    add_block();
  }
  if (state_ == 1) {
    recv2_->wait();
    send2_->wait();
    finish();
  }
}

template <class T>
HostFirstGather<T>::HostFirstGather(PointToPoint& net, const HostPlan& plan, int me, T* out,
                                    const T* in, const int64_t* counts, int tag1, int tag2)
    : net_(net), tag2_(tag2) {
  const int P = plan.size(), h = plan.host_of(me);
  const std::vector<int64_t> c(counts, counts + P), at = host_first_offsets(c);
  bytes_to_.assign(size_t(P), 0);
  const size_t mine = size_t(c[size_t(me)]);
  if (mine > 0 && out + at[size_t(me)] != in) std::memmove(out + at[size_t(me)], in, mine * sizeof(T));
  std::vector<Transfer> sends, recvs, later;
  auto send = [&](std::vector<Transfer>& to, T* data, size_t n, int peer) {
    if (n == 0) return;
    to.push_back({data, n, peer});
    bytes_to_[size_t(peer)] += int64_t(n * sizeof(T));
  };
  T* const me_in = const_cast<T*>(in);
  for (int m : plan.members(h))
    if (m != me) {
      send(sends, me_in, mine, m);
      if (c[size_t(m)] > 0) recvs.push_back({out + at[size_t(m)], size_t(c[size_t(m)]), m});
    }
  for (int g = 0; g < plan.hosts(); ++g)
    if (g != h) send(sends, me_in, mine, plan.gateway(g, me));
  for (int s = 0; s < P; ++s) {
    const size_t n = size_t(c[size_t(s)]);
    if (plan.host_of(s) == h || n == 0) continue;
    const int gate = plan.gateway(h, s);
    if (gate == me) {
      recvs.push_back({out + at[size_t(s)], n, s});
      for (int m : plan.members(h))
        if (m != me) send(forward_, out + at[size_t(s)], n, m);
    } else {
      later.push_back({out + at[size_t(s)], n, gate});
    }
  }
  round1_ = net.post(sends, recvs, sizeof(T), tag1);
  recv2_ = net.post({}, later, sizeof(T), tag2);
}

template <class T>
HostFirstGather<T>::~HostFirstGather() {
  if (state_ != 2 && std::uncaught_exceptions() == 0) wait();
}

template <class T>
bool HostFirstGather<T>::test() {
  if (state_ == 0) {
    if (!round1_->test()) return false;
    send2_ = net_.post(forward_, {}, sizeof(T), tag2_);
    state_ = 1;
  }
  if (state_ == 1) {
    const bool got = recv2_->test(), sent = send2_->test();
    if (!got || !sent) return false;
    state_ = 2;
  }
  return true;
}

template <class T>
void HostFirstGather<T>::wait() {
  if (state_ == 0) {
    round1_->wait();
    send2_ = net_.post(forward_, {}, sizeof(T), tag2_);
    state_ = 1;
  }
  if (state_ == 1) {
    recv2_->wait();
    send2_->wait();
    state_ = 2;
  }
}

CountedOp::~CountedOp() {
  op_.reset();  // waits for it (unless unwinding)
  if (!done_) --live_;
}

bool CountedOp::test() {
  if (!done_ && op_->test()) {
    done_ = true;
    --live_;
  }
  return done_;
}

void CountedOp::wait() {
  if (done_) return;
  op_->wait();
  done_ = true;
  --live_;
}

template class HostFirstReduce<float>;
template class HostFirstReduce<double>;
template class HostFirstGather<float>;
template class HostFirstGather<double>;

}  // namespace sigma
