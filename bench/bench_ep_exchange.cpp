// The expert layers' communication in one training step (issue 11, docs/benchmarks.md): Random
// Routed Experts against a learned top-2 gate, on the real communicator (dist/communicator.h),
// with token ids from the shared corpus through the project's tokenizer and the model's routing
// tables. Only the exchanges run (no expert FFN): each block's forward sends every token's row
// to the rank holding its expert and back (dispatch, combine), and backward does the same with
// the gradients, as an expert-parallel step does.
//   rre          counts follow from (group, token id) through routing.{l}.{g}, which every rank
//                can evaluate for every rank's tokens (it has the global batch's ids, as the
//                trainer does): one row per token, all_to_all_v on the group's communicator,
//                no count exchange, no capacity, nothing dropped.
//   top2-group   Sigma's gate (model/gate.h) inside the group: a gate over the group's K
//                experts picks two per token once the block's input exists, so each block first
//                exchanges counts; rows go padded to capacity, on the group's communicator.
//   top2-global  the GShard-style baseline: one gate over every group's experts, placed over all
//                ranks; count exchange and padded rows on the world communicator.
// The gate's input is LayerNorm(embedding + position) with random N(0, 0.02) tables and gate
// weights: a gate at initialisation, on the real token ids.
//
//   mpirun --allow-run-as-root --oversubscribe --bind-to none -np R ./build/bench_ep_exchange
//     [--groups 1,2,4] [--d 128] [--seq 128] [--batch 8] [--blocks 4] [--experts 4] ...
// --help lists every option. The bench checks its own invariants (RRE sends nothing outside a
// group, every received row belongs to an expert of the receiving rank, each round trip returns
// the rows it sent, byte totals match the token count) and exits 1 when one fails; 77 when the
// corpus is missing. --inject-leak places RRE experts over all ranks, to show the check fire.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "core/rng.h"
#include "data/jsonl.h"
#include "data/prepare.h"
#include "data/tokenizer.h"
#include "dist/communicator.h"
#include "model/routing.h"

using namespace sigma;

namespace {

struct Options {
  std::string data = "../shared/data";  // the corpus folder: corpus/<domain>/train.jsonl
  std::string tokenizer;                // a trained tokenizer file; empty = train one here
  std::vector<int> groups{1, 2, 4};     // expert-group layouts to run (domains merged: below)
  int d = 128, seq = 128, batch = 8;    // width, tokens per row, rows per rank and step
  int blocks = 4, experts = 4;          // RRE blocks, experts per group and block
  int steps = 5, warmup = 1;
  float capacity = 1.25f;               // the gate's capacity factor (model.capacity_factor)
  int vocab = 4096;                     // trained tokenizer size
  int64_t sample_bytes = 256 << 10;     // text read per domain
  uint64_t seed = 1;
  bool inject_leak = false;
};

const char* kUsage =
    "usage: bench_ep_exchange [--data DIR] [--tokenizer FILE] [--groups 1,2,4] [--d N] [--seq N]\n"
    "  [--batch ROWS] [--blocks N] [--experts K] [--steps N] [--warmup N] [--capacity CF]\n"
    "  [--vocab N] [--sample-bytes N] [--seed N] [--inject-leak] [--tiny]\n";

std::vector<int> int_list(const std::string& s) {
  std::vector<int> out;
  for (size_t at = 0; at <= s.size();) {
    size_t comma = s.find(',', at);
    if (comma == std::string::npos) comma = s.size();
    out.push_back(std::stoi(s.substr(at, comma - at)));
    at = comma + 1;
  }
  return out;
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--data") o.data = value();
    else if (a == "--tokenizer") o.tokenizer = value();
    else if (a == "--groups") o.groups = int_list(value());
    else if (a == "--d") o.d = std::stoi(value());
    else if (a == "--seq") o.seq = std::stoi(value());
    else if (a == "--batch") o.batch = std::stoi(value());
    else if (a == "--blocks") o.blocks = std::stoi(value());
    else if (a == "--experts") o.experts = std::stoi(value());
    else if (a == "--steps") o.steps = std::stoi(value());
    else if (a == "--warmup") o.warmup = std::stoi(value());
    else if (a == "--capacity") o.capacity = std::stof(value());
    else if (a == "--vocab") o.vocab = std::stoi(value());
    else if (a == "--sample-bytes") o.sample_bytes = std::stoll(value());
    else if (a == "--seed") o.seed = std::stoull(value());
    else if (a == "--inject-leak") o.inject_leak = true;
    else if (a == "--tiny") o.d = 16, o.seq = 16, o.batch = 2, o.blocks = 2, o.steps = 2,
                            o.warmup = 0, o.vocab = 600, o.sample_bytes = 16 << 10;
    else throw std::runtime_error("unknown option " + a + "\n" + kUsage);
  }
  for (int g : o.groups)
    if (g != 1 && g != 2 && g != 4) throw std::runtime_error("--groups takes 1, 2 or 4");
  if (o.d < 4 || o.seq < 1 || o.batch < 1 || o.blocks < 1 || o.experts < 2 || o.steps < 1 ||
      o.capacity <= 0)
    throw std::runtime_error("need --d >= 4, --experts >= 2, positive sizes and capacity");
  return o;
}

// ---------------------------------------------------------------------------------------------
// Token ids from the corpus: the shared data's domains, formatted as `sigma prepare` does.

struct Corpus {
  std::vector<DomainSpec> domains;
  std::vector<std::vector<uint32_t>> streams;  // [domain] formatted samples, concatenated
  int vocab = 0;
};

// The domain registry of configs/shared-data.prepare.json; its four groups, or coarser layouts
// with the same domains (2: text and code; 1: one group).
std::vector<DomainSpec> shared_domains(int groups) {
  struct D { const char *name, *g4, *g2; const char* prefix; bool bilingual; };
  const D ds[] = {{"english", "en", "text", nullptr, false},  {"chinese", "zh", "text", nullptr, false},
                  {"poetry", "zh", "text", nullptr, false},    {"bilingual", "enzh", "text", nullptr, true},
                  {"python", "code", "code", "<Python>", false}, {"java", "code", "code", "<Java>", false}};
  std::vector<DomainSpec> out;
  for (const D& d : ds) {
    DomainSpec s(d.name, groups == 4 ? d.g4 : groups == 2 ? d.g2 : "all", 0);
    if (d.prefix) s.prefix = {d.prefix};
    if (d.bilingual) s.format = SampleFormat::Bilingual;
    out.push_back(s);
  }
  return out;
}

Corpus read_corpus(const Options& o) {
  Corpus c;
  c.domains = shared_domains(4);
  std::vector<std::vector<std::string>> texts(c.domains.size());
  for (size_t i = 0; i < c.domains.size(); ++i) {
    const data::Source src{o.data + "/corpus/" + c.domains[i].name + "/train.jsonl", c.domains[i].name};
    data::ReadStats stats;
    int64_t bytes = 0;
    data::read_source(src, {}, stats, [&](data::Record& r) {
      if (bytes >= o.sample_bytes) return;  // the file's first sample_bytes of text
      bytes += int64_t(r.text.size());
      texts[i].push_back(std::move(r.text));
    });
    if (texts[i].empty()) throw std::runtime_error("no records in " + src.path);
  }
  data::Tokenizer tok;
  if (!o.tokenizer.empty()) {
    tok = data::Tokenizer::load(o.tokenizer);
  } else {
    data::BpeTrainer trainer({.vocab_size = uint32_t(o.vocab)});
    for (const auto& t : texts)
      for (const auto& s : t) trainer.add(s);
    tok = trainer.finish();
  }
  c.vocab = int(tok.vocab_size());
  c.streams.resize(c.domains.size());
  std::vector<uint32_t> sample;
  for (size_t i = 0; i < c.domains.size(); ++i)
    for (const auto& s : texts[i]) {
      data::format_sample(tok, c.domains[i], "", s, sample);
      c.streams[i].insert(c.streams[i].end(), sample.begin(), sample.end());
    }
  return c;
}

// ---------------------------------------------------------------------------------------------
// Placement: G groups over R ranks. With G <= R each group gets R/G ranks of its own; with
// G > R each rank holds G/R whole groups. Either way the groups' rank sets are disjoint.

struct Layout {
  int R = 1, G = 1, sets = 1, per_set = 1;
  std::vector<std::string> names;  // [G]
  Layout(int R_, int G_) : R(R_), G(G_), sets(std::min(R_, G_)), per_set(R_ / sets) {
    if (R % sets != 0 || G % sets != 0)
      throw std::runtime_error(fmt::format("{} groups do not split evenly over {} ranks", G, R));
  }
  int set_of_rank(int r) const { return r / per_set; }
  int set_of_group(int g) const { return g * sets / G; }
  int group_index(const std::string& name) const {
    return int(std::find(names.begin(), names.end(), name) - names.begin());
  }
};

// The step's token ids, every rank's: rank r's rows come from the domains of its groups (a
// domain's data goes to its group's ranks), cycling over those domains, windows of `seq`
// consecutive tokens of each domain's stream.
struct Tokens {
  std::vector<int32_t> ids;    // [steps][R][batch*seq]
  std::vector<int32_t> group;  // [steps][R][batch]
};

Tokens step_tokens(const Corpus& c, const Layout& L, const Options& o, int steps) {
  const auto doms = shared_domains(L.G);
  const int64_t n = int64_t(o.batch) * o.seq;
  Tokens t;
  t.ids.resize(size_t(steps) * L.R * n);
  t.group.resize(size_t(steps) * L.R * o.batch);
  std::vector<size_t> cursor(doms.size(), 0);
  for (int s = 0; s < steps; ++s)
    for (int r = 0; r < L.R; ++r) {
      std::vector<int> mine;  // domains whose group lives on r's rank set
      for (size_t i = 0; i < doms.size(); ++i)
        if (L.set_of_group(L.group_index(doms[i].group)) == L.set_of_rank(r))
          mine.push_back(int(i));
      for (int row = 0; row < o.batch; ++row) {
        const int dom = mine[size_t(s * o.batch + row) % mine.size()];
        const auto& st = c.streams[size_t(dom)];
        int32_t* out = t.ids.data() + (size_t(s) * L.R + r) * n + size_t(row) * o.seq;
        for (int i = 0; i < o.seq; ++i) out[i] = int32_t(st[(cursor[size_t(dom)] + size_t(i)) % st.size()]);
        cursor[size_t(dom)] = (cursor[size_t(dom)] + size_t(o.seq)) % st.size();
        t.group[(size_t(s) * L.R + r) * o.batch + size_t(row)] = L.group_index(doms[size_t(dom)].group);
      }
    }
  return t;
}

// ---------------------------------------------------------------------------------------------
// Exchanges and what CommStats says about them.

struct Tally {
  int64_t calls = 0, count_calls = 0;      // all collectives; those that carry gate counts
  int64_t bytes = 0, off_rank = 0, off_group = 0, count_bytes = 0;
  int64_t padded_rows = 0, real_rows = 0;  // rows sent: all slots, and the tokens among them
  int64_t dropped = 0, choices = 0;        // the gate's (token, choice) pairs over capacity
  int64_t recv_real = 0;                   // token rows this rank's experts received
  double seconds = 0;                      // inside the collectives
};

// One all_to_all_v (counts in rows of `width` floats) on c, its bytes taken from c's CommStats
// (per world rank) and sorted into off-rank and off-group, its time added.
void exchange(Tally& t, Communicator& c, const Layout& L, int me, const std::vector<float>& send,
              const std::vector<int64_t>& send_rows, std::vector<float>& recv,
              const std::vector<int64_t>& recv_rows, int64_t width, bool counts = false) {
  std::vector<int64_t> sc(send_rows.size()), rc(recv_rows.size());
  int64_t total = 0;
  for (size_t i = 0; i < sc.size(); ++i) sc[i] = send_rows[i] * width, rc[i] = recv_rows[i] * width;
  for (int64_t n : rc) total += n;
  recv.resize(size_t(total));
  const CommStats before = c.stats();
  const auto a = std::chrono::steady_clock::now();
  c.all_to_all_v(send.data(), sc.data(), recv.data(), rc.data());
  t.seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count();
  const CommStats& after = c.stats();
  t.calls += after.calls - before.calls;
  if (counts) t.count_calls += after.calls - before.calls;
  for (int w = 0; w < int(after.bytes_to.size()); ++w) {
    const int64_t b = after.bytes_to[size_t(w)] - (before.bytes_to.empty() ? 0 : before.bytes_to[size_t(w)]);
    t.bytes += b;
    if (counts) t.count_bytes += b;
    if (w != me) t.off_rank += b;
    if (L.set_of_rank(w) != L.set_of_rank(me)) t.off_group += b;
  }
}

// Rows to send, packed by destination member: a row's first floats say what it is (token id,
// group, position, 1 = a token / 0 = padding), so the receiver can check where it landed.
struct Packed {
  std::vector<float> rows;
  std::vector<int64_t> count;  // [members] rows (slots) to each
};

void fill_row(float* row, int64_t d, int32_t tok, int g, int64_t pos, bool real) {
  row[0] = float(tok), row[1] = float(g), row[2] = float(pos), row[3] = real ? 1.0f : 0.0f;
  for (int64_t j = 4; j < d; ++j) row[j] = 0.25f * float(j % 7);
}

std::vector<std::string>& violations() {
  static std::vector<std::string> v;
  return v;
}

void expect(bool ok, const std::string& what) {
  if (!ok && violations().size() < 20) violations().push_back(what);
}

// Dispatch and combine of one block, forward and backward: four all_to_all_v calls. `check`
// says whether a received row belongs to this rank's experts.
template <class Check>
void four_ways(Tally& t, Communicator& c, const Layout& L, int me, const Packed& p,
               const std::vector<int64_t>& recv_rows, int64_t d, Check&& check) {
  std::vector<float> at_experts, back;
  for (int pass = 0; pass < 2; ++pass) {  // forward (x rows), backward (dy rows)
    exchange(t, c, L, me, p.rows, p.count, at_experts, recv_rows, d);
    for (size_t i = 0; i < at_experts.size(); i += size_t(d)) {
      const float* row = at_experts.data() + i;
      if (row[3] == 1.0f) {
        ++t.recv_real;
        check(int32_t(row[0]), int(row[1]), int64_t(row[2]));
      }
    }
    exchange(t, c, L, me, at_experts, recv_rows, back, p.count, d);  // the identity "expert"
    expect(back.size() == p.rows.size() &&
               std::memcmp(back.data(), p.rows.data(), back.size() * sizeof(float)) == 0,
           fmt::format("rank {}: a round trip did not return the rows it sent", me));
  }
}

}  // namespace

namespace {

// ---------------------------------------------------------------------------------------------
// The patterns. A Pattern knows its communicator and where each expert lives in it.

enum class Kind { Rre, GateGroup, GateGlobal };
const char* kind_name(Kind k) {
  return k == Kind::Rre ? "rre" : k == Kind::GateGroup ? "top2-group" : "top2-global";
}

struct Context {
  const Options& o;
  const Layout& L;
  const Tokens& tok;
  int vocab;
  Communicator& world;
  Communicator& group;  // this rank's set of ranks (split by set)
  std::vector<std::vector<std::vector<int32_t>>> tables;  // [block][group] routing.{l}.{g}
  std::vector<float> emb, pos, gate_w;  // [V,d], [seq,d], [blocks][d, G*K]: N(0, 0.02)
  int me = 0;
};

// Member index in the pattern's communicator of the rank that holds expert `e` of group `g`.
int owner(const Context& c, Kind k, int g, int e, bool leak) {
  if (k == Kind::GateGlobal) return (g * c.o.experts + e) % c.L.R;
  if (k == Kind::Rre && leak) return (e + g + 1) % c.L.R;  // ignores the groups: the fault
  return e % c.L.per_set;
}

bool on_world(Kind k, bool leak) { return k == Kind::GateGlobal || (k == Kind::Rre && leak); }

// World rank of member m of this rank's communicator for pattern k.
int world_of(const Context& c, Kind k, int m) {
  return on_world(k, c.o.inject_leak) ? m : c.L.set_of_rank(c.me) * c.L.per_set + m;
}

const int32_t* ids_of(const Context& c, int step, int w) {
  return c.tok.ids.data() + (size_t(step) * c.L.R + size_t(w)) * size_t(c.o.batch) * c.o.seq;
}
int group_of(const Context& c, int step, int w, int64_t i) {
  return c.tok.group[(size_t(step) * c.L.R + size_t(w)) * c.o.batch + size_t(i / c.o.seq)];
}

// One RRE block: every member's counts from its token ids (no exchange), then the rows.
void rre_block(Tally& t, Context& c, int step, int l) {
  const bool leak = c.o.inject_leak;
  Communicator& comm = leak ? c.world : c.group;
  const int P = comm.size(), mine = comm.rank();
  const int64_t n = int64_t(c.o.batch) * c.o.seq, d = c.o.d;
  auto dest = [&](const int32_t* ids, int w, int64_t i) {
    const int g = group_of(c, step, w, i);
    return owner(c, Kind::Rre, g, c.tables[size_t(l)][size_t(g)][size_t(ids[i])], leak);
  };
  std::vector<int64_t> recv_rows(static_cast<size_t>(P), 0);
  for (int m = 0; m < P; ++m) {
    const int w = world_of(c, Kind::Rre, m);
    const int32_t* ids = ids_of(c, step, w);
    for (int64_t i = 0; i < n; ++i) recv_rows[size_t(m)] += dest(ids, w, i) == mine;
  }
  Packed p;
  p.count.assign(size_t(P), 0);
  const int32_t* ids = ids_of(c, step, c.me);
  std::vector<std::vector<int64_t>> by_dest(static_cast<size_t>(P));
  for (int64_t i = 0; i < n; ++i) by_dest[size_t(dest(ids, c.me, i))].push_back(i);
  p.rows.resize(size_t(n * d));
  float* at = p.rows.data();
  for (int m = 0; m < P; ++m) {
    p.count[size_t(m)] = int64_t(by_dest[size_t(m)].size());
    for (int64_t i : by_dest[size_t(m)]) {
      fill_row(at, d, ids[i], group_of(c, step, c.me, i), i % c.o.seq, true);
      at += d;
    }
  }
  t.padded_rows += 2 * n, t.real_rows += 2 * n;  // forward and backward dispatch
  four_ways(t, comm, c.L, c.me, p, recv_rows, d, [&](int32_t tok, int g, int64_t) {
    expect(owner(c, Kind::Rre, g, c.tables[size_t(l)][size_t(g)][size_t(tok)], leak) == mine,
           fmt::format("rank {}: block {} got token {} of group {} for another rank's expert", c.me, l, tok, g));
  });
}

// The gate's two experts (global indices g*K + e) for token `tok` at position `p` of group g:
// softmax(LN(emb[tok] + pos[p]) W) over the group's K columns (top2-group) or all G*K.
std::pair<int, int> top2(const Context& c, Kind k, int l, int32_t tok, int g, int64_t p) {
  const int64_t d = c.o.d, E = int64_t(c.L.G) * c.o.experts;
  std::vector<float> x(static_cast<size_t>(d));
  double mean = 0, var = 0;
  for (int64_t j = 0; j < d; ++j) mean += x[size_t(j)] = c.emb[size_t(tok * d + j)] + c.pos[size_t(p * d + j)];
  mean /= double(d);
  for (int64_t j = 0; j < d; ++j) var += (x[size_t(j)] - mean) * (x[size_t(j)] - mean);
  const float inv = float(1.0 / std::sqrt(var / double(d) + 1e-5));
  for (auto& v : x) v = (v - float(mean)) * inv;
  const int lo = k == Kind::GateGlobal ? 0 : g * c.o.experts;
  const int hi = k == Kind::GateGlobal ? int(E) : lo + c.o.experts;
  int e1 = -1, e2 = -1;
  float z1 = -INFINITY, z2 = -INFINITY;  // softmax is monotone: the top two logits
  const float* w = c.gate_w.data() + size_t(l) * size_t(d * E);
  for (int e = lo; e < hi; ++e) {
    float z = 0;
    for (int64_t j = 0; j < d; ++j) z += x[size_t(j)] * w[size_t(j * E + e)];
    if (z > z1) e2 = e1, z2 = z1, e1 = e, z1 = z;
    else if (z > z2) e2 = e, z2 = z;
  }
  return {e1, e2};
}

// One gated block: the gate's choices, capacity (first choices before second, tokens in order,
// as model/gate.h), an exchange of (slots, tokens) per expert, then the padded rows.
void gate_block(Tally& t, Context& c, Kind k, int step, int l) {
  Communicator& comm = k == Kind::GateGlobal ? c.world : c.group;
  const int P = comm.size(), mine = comm.rank(), K = c.o.experts, E = c.L.G * K;
  const int64_t n = int64_t(c.o.batch) * c.o.seq, d = c.o.d;
  std::vector<std::vector<int>> owned(static_cast<size_t>(P));  // [member] its experts, ascending
  for (int ge = 0; ge < E; ++ge) {
    const int g = ge / K;
    if (k == Kind::GateGroup && c.L.set_of_group(g) != c.L.set_of_rank(c.me)) continue;
    owned[size_t(owner(c, k, g, ge % K, false))].push_back(ge);
  }
  const int32_t* ids = ids_of(c, step, c.me);
  std::vector<int64_t> in_scope(static_cast<size_t>(c.L.G), 0);
  std::vector<std::pair<int, int>> choice(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const int g = group_of(c, step, c.me, i);
    ++in_scope[size_t(g)];
    choice[size_t(i)] = top2(c, k, l, ids[i], g, i % c.o.seq);
  }
  std::vector<int64_t> cap(static_cast<size_t>(E));
  for (int ge = 0; ge < E; ++ge)
    cap[size_t(ge)] = k == Kind::GateGlobal ? int64_t(std::ceil(c.o.capacity * 2.0 * double(n) / E))
                                            : int64_t(std::ceil(c.o.capacity * 2.0 * double(in_scope[size_t(ge / K)]) / K));
  std::vector<std::vector<int64_t>> kept(static_cast<size_t>(E));  // tokens each expert takes
  for (int slot = 0; slot < 2; ++slot)
    for (int64_t i = 0; i < n; ++i) {
      const int ge = slot == 0 ? choice[size_t(i)].first : choice[size_t(i)].second;
      if (int64_t(kept[size_t(ge)].size()) < cap[size_t(ge)]) kept[size_t(ge)].push_back(i);
      else ++t.dropped;
    }
  t.choices += 2 * n;
  Packed p;
  std::vector<float> counts;
  std::vector<int64_t> count_rows(static_cast<size_t>(P)), recv_count_rows(size_t(P), 2 * int64_t(owned[size_t(mine)].size()));
  for (int m = 0; m < P; ++m) {
    for (int ge : owned[size_t(m)]) {
      counts.push_back(float(cap[size_t(ge)]));
      counts.push_back(float(kept[size_t(ge)].size()));
      for (int64_t s = 0; s < cap[size_t(ge)]; ++s) {
        const bool real = s < int64_t(kept[size_t(ge)].size());
        const int64_t i = real ? kept[size_t(ge)][size_t(s)] : 0;
        p.rows.resize(p.rows.size() + size_t(d));
        fill_row(p.rows.data() + p.rows.size() - size_t(d), d, ids[i], group_of(c, step, c.me, i), i % c.o.seq, real);
        t.padded_rows += 2, t.real_rows += real ? 2 : 0;
      }
    }
    count_rows[size_t(m)] = 2 * int64_t(owned[size_t(m)].size());
    p.count.push_back(0);
    for (int ge : owned[size_t(m)]) p.count.back() += cap[size_t(ge)];
  }
  std::vector<float> got;
  exchange(t, comm, c.L, c.me, counts, count_rows, got, recv_count_rows, 1, true);
  std::vector<int64_t> recv_rows(static_cast<size_t>(P), 0);
  int64_t expected_real = 0;
  for (int q = 0; q < P; ++q)
    for (size_t j = 0; j < owned[size_t(mine)].size(); ++j) {
      recv_rows[size_t(q)] += int64_t(got[size_t(q) * 2 * owned[size_t(mine)].size() + 2 * j]);
      expected_real += int64_t(got[size_t(q) * 2 * owned[size_t(mine)].size() + 2 * j + 1]);
    }
  const int64_t before = t.recv_real;
  four_ways(t, comm, c.L, c.me, p, recv_rows, d, [&](int32_t tok, int g, int64_t pos) {
    const auto [e1, e2] = top2(c, k, l, tok, g, pos);
    expect(owner(c, k, e1 / K, e1 % K, false) == mine || owner(c, k, e2 / K, e2 % K, false) == mine,
           fmt::format("rank {}: block {} got token {} that its gate sent to other ranks", c.me, l, tok));
  });
  expect(t.recv_real - before == 2 * expected_real,
         fmt::format("rank {}: block {} received {} token rows, the counts said {}", c.me, l,
                     (t.recv_real - before) / 2, expected_real));
}

Tally run_pattern(Context& c, Kind k) {
  Tally t;
  for (int s = 0; s < c.o.warmup + c.o.steps; ++s) {
    if (s == c.o.warmup) t = Tally{};
    c.world.barrier();
    for (int l = 0; l < c.o.blocks; ++l) {
      if (k == Kind::Rre) rre_block(t, c, s, l);
      else gate_block(t, c, k, s, l);
    }
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// Report and the checks across ranks.

constexpr int kFields = 12;
std::vector<double> fields(const Tally& t) {
  return {double(t.calls), double(t.count_calls), double(t.bytes), double(t.off_rank),
          double(t.off_group), double(t.count_bytes), double(t.padded_rows), double(t.real_rows),
          double(t.dropped), double(t.choices), double(t.recv_real), t.seconds};
}

// What every rank's tally says together: the table row (rank 0 prints it) and the invariants.
void report(Communicator& world, const Options& o, Kind k, const Tally& t, int64_t tokens_per_rank) {
  const int R = world.size();
  std::vector<double> all(static_cast<size_t>(R) * kFields);
  world.all_gather(all.data(), fields(t).data(), kFields);
  auto col = [&](int f) {
    std::vector<double> v(static_cast<size_t>(R));
    for (int r = 0; r < R; ++r) v[size_t(r)] = all[size_t(r) * kFields + size_t(f)];
    return v;
  };
  auto max = [](const std::vector<double>& v) { return *std::max_element(v.begin(), v.end()); };
  auto sum = [](const std::vector<double>& v) { double s = 0; for (double x : v) s += x; return s; };
  if (world.rank() != 0) return;  // the checks below see every rank's tally
  const double steps = o.steps, blocks = o.blocks, secs = max(col(11));
  const double tokens = double(tokens_per_rank) * R * steps * blocks;  // (token, block) pairs
  if (k == Kind::Rre) {
    for (int r = 0; r < R; ++r)
      expect(col(4)[size_t(r)] == 0, fmt::format("rre: rank {} sent {} bytes to ranks outside its "
                                                 "group", r, col(4)[size_t(r)]));
    expect(max(col(1)) == 0 && sum(col(8)) == 0, "rre: a count exchange or a dropped token");
    expect(max(col(0)) == 4 * blocks * steps, "rre: not 4 collectives per block");
    expect(sum(col(7)) == 2 * tokens && sum(col(2)) == 4 * tokens * o.d * 4,
           "rre: rows or bytes sent differ from one row per token each way");
  } else {
    expect(max(col(1)) == blocks * steps, fmt::format("{}: not one count exchange per block", kind_name(k)));
    for (int r = 0; r < R; ++r)
      expect(col(7)[size_t(r)] / 2 + col(8)[size_t(r)] == col(9)[size_t(r)],
             fmt::format("{}: rank {} kept + dropped != 2 per token", kind_name(k), r));
  }
  expect(sum(col(10)) == sum(col(7)), fmt::format("{}: token rows received != sent", kind_name(k)));
  const double padded = sum(col(6)), real = sum(col(7)), mean_recv = sum(col(10)) / R;
  fmt::print("{:<12} {:>6.0f} {:>6.0f} {:>10.1f} {:>10.1f} {:>10.1f} {:>8.1f} {:>8.2f} {:>8.3f} {:>7.2f} {:>6.2f}\n",
             kind_name(k), max(col(0)) / steps, max(col(1)) / steps, max(col(2)) / steps / 1024,
             max(col(3)) / steps / 1024, max(col(4)) / steps / 1024,
             padded > 0 ? 100 * (padded - real) / padded : 0.0,
             sum(col(9)) > 0 ? 100 * sum(col(8)) / sum(col(9)) : 0.0, secs / steps * 1e3,
             sum(col(3)) / R / secs / 1e9, mean_recv > 0 ? max(col(10)) / mean_recv : 0.0);
}

std::vector<std::string> group_names(int G) {
  std::vector<std::string> out;
  for (const auto& d : shared_domains(G))
    if (std::find(out.begin(), out.end(), d.group) == out.end()) out.push_back(d.group);
  return out;
}

std::vector<float> normal_table(uint64_t seed, const char* name, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = 0.02f * rng_normal(seed, stream_of(name), i);
  return v;
}

// The step's token ids: built on rank 0 from the corpus, sent to every rank once (setup, not
// timed: the trainer's ranks read the global batch themselves).
Tokens share_tokens(Communicator& world, const Corpus& corpus, const Layout& L, const Options& o) {
  const int steps = o.warmup + o.steps;
  Tokens t;
  if (world.rank() == 0) t = step_tokens(corpus, L, o, steps);
  t.ids.resize(size_t(steps) * L.R * o.batch * o.seq);
  t.group.resize(size_t(steps) * L.R * o.batch);
  world.broadcast(t.ids.data(), t.ids.size() * sizeof(int32_t), 0);
  world.broadcast(t.group.data(), t.group.size() * sizeof(int32_t), 0);
  return t;
}

void run_layout(Communicator& world, const Corpus& corpus, int vocab, const Options& o, int G) {
  Layout L(world.size(), G);
  L.names = group_names(G);
  const Tokens tok = share_tokens(world, corpus, L, o);
  const auto group = world.split(L.set_of_rank(world.rank()));
  Context c{o, L, tok, vocab, world, *group, {}, {}, {}, {}, world.rank()};
  c.tables.resize(size_t(o.blocks));
  for (int l = 0; l < o.blocks; ++l)
    for (const auto& name : L.names)
      c.tables[size_t(l)].push_back(random_routing_table(vocab, o.experts, o.seed, l, name));
  c.emb = normal_table(o.seed, "emb", size_t(vocab) * o.d);
  c.pos = normal_table(o.seed, "pos", size_t(o.seq) * o.d);
  c.gate_w = normal_table(o.seed, "gate", size_t(o.blocks) * o.d * G * o.experts);
  if (world.rank() == 0) {
    std::string where;
    for (int g = 0; g < G; ++g) {
      const int s = L.set_of_group(g);
      where += fmt::format("{}{} on ranks {}-{}", g ? ", " : "", L.names[size_t(g)], s * L.per_set,
                           (s + 1) * L.per_set - 1);
    }
    fmt::print("\n{} group(s) x {} experts, {} ranks: {}{}\n", G, o.experts, L.R, where,
               o.inject_leak ? " (--inject-leak: RRE experts placed over all ranks)" : "");
    fmt::print("{:<12} {:>6} {:>6} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8} {:>7} {:>6}\n", "pattern",
               "calls", "counts", "KiB/rank", "off-rank", "off-group", "pad %", "drop %",
               "comm ms", "GB/s", "load");
  }
  for (Kind k : {Kind::Rre, Kind::GateGroup, Kind::GateGlobal})
    report(world, o, k, run_pattern(c, k), int64_t(o.batch) * o.seq);
}

}  // namespace

int main(int argc, char** argv) {
  const auto world = make_world(120);
  Communicator& w = *world;
  try {
    const Options o = parse(argc, argv);
    if (!std::filesystem::exists(o.data + "/corpus")) {
      if (w.rank() == 0) fmt::print(stderr, "bench_ep_exchange: no corpus at {}/corpus (--data)\n", o.data);
      return 77;
    }
    Corpus corpus;
    if (w.rank() == 0) corpus = read_corpus(o);
    int vocab = corpus.vocab;
    w.broadcast(&vocab, sizeof vocab, 0);
    if (w.rank() == 0) {
      size_t total = 0;
      for (const auto& s : corpus.streams) total += s.size();
      fmt::print("bench_ep_exchange: {} ranks; d={} seq={} rows/rank={} ({} tokens/rank/step), "
                 "{} blocks, capacity factor {}; {} steps after {} warm-up\n"
                 "tokens: {} from the first {} KiB of each of {} domains in {}, vocab {}\n"
                 "per step and rank (max over ranks): collectives, count exchanges, KiB sent (self "
                 "included), KiB to other ranks, KiB outside the rank's group; padding share of "
                 "rows sent, dropped (token, choice) pairs, time in the collectives, algorithm "
                 "bandwidth (bytes leaving a rank / slowest rank's time), expert-rank load max/mean\n",
                 w.size(), o.d, o.seq, o.batch, o.batch * o.seq, o.blocks, o.capacity, o.steps,
                 o.warmup, total, o.sample_bytes >> 10, corpus.streams.size(), o.data, vocab);
    }
    for (int G : o.groups) run_layout(w, corpus, vocab, o, G);
    for (const auto& v : violations()) fmt::print(stderr, "invariant violated: {}\n", v);
    int bad = violations().empty() ? 0 : 1;
    std::vector<float> mine{float(bad)}, all(size_t(w.size()));
    w.all_gather(all.data(), mine.data(), 1);
    bad = *std::max_element(all.begin(), all.end()) > 0;
    if (w.rank() == 0) fmt::print("invariants: {}\n", bad ? "VIOLATED" : "ok");
    return bad;
  } catch (const std::exception& e) {
    fmt::print(stderr, "bench_ep_exchange: {}\n", e.what());
    abort_run(2);
    return 2;
  }
}
