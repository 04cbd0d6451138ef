// Inherit (DESIGN §4): a dense PanGu-α checkpoint + a sparse config -> a PanGu-Σ checkpoint.
// With an unchanged vocabulary and every slot a copy of a dense slot, the sparse model computes
// the dense model's function: each expert of block l is the dense FFN of block l, so whatever
// expert a token routes to, it applies the same FFN.
#include <fmt/format.h>

#include <cstring>
#include <unordered_map>

#include "core/rng.h"
#include "data/tokenizer.h"
#include "model/params.h"
#include "model/names.h"
#include "model/routing.h"
#include "model/weights.h"
#include "surgery/surgery.h"
#include "run/data_source.h"

namespace sigma::surgery {

namespace {

void check_same(const char* key, int dense, int sparse, const std::string& dir) {
  SIGMA_CHECK(dense == sparse,
              "the dense model {} has model.{} = {} but the sparse config has {}: inherit needs "
              "the same width, depth, heads and context (set model.{} = {})",
              dir, key, dense, sparse, key, dense);
}

// For each id of the new tokenizer, the dense ids whose rows make its row: the dense id with
// the same string when there is one (controls match by name, other tokens by their bytes, the
// lowest dense id when several spell the same bytes), else the dense tokenizer's encoding of
// its bytes (the row is then their mean), else nothing (a control the dense model lacks: the
// slot's mean row). Every dense control must exist in the new tokenizer.
std::vector<std::vector<int64_t>> map_vocab(const data::Tokenizer& dense,
                                            const data::Tokenizer& grown,
                                            const std::string& grown_path) {
  for (const std::string& c : dense.controls())
    SIGMA_CHECK(grown.find_control(c).has_value(),
                "tokenizer {} does not cover the dense vocabulary: it lacks the control token "
                "'{}'", grown_path, c);
  std::unordered_map<std::string, int64_t> by_bytes;
  for (uint32_t id = dense.vocab_size(); id-- > dense.n_controls();)
    by_bytes[dense.token_bytes(id)] = id;  // descending, so the lowest id wins
  std::vector<std::vector<int64_t>> map(grown.vocab_size());
  for (uint32_t id = 0; id < grown.vocab_size(); ++id) {
    if (grown.is_control(id)) {
      if (auto d = dense.find_control(grown.token_bytes(id))) map[id] = {*d};
      continue;
    }
    auto it = by_bytes.find(grown.token_bytes(id));
    if (it != by_bytes.end()) {
      map[id] = {it->second};
    } else {
      for (uint32_t p : dense.encode(grown.token_bytes(id))) map[id].push_back(p);
    }
  }
  return map;
}

}  // namespace

NamedModel inherit(const NamedModel& dense, Config sparse, const InheritOptions& opt,
                   InheritReport* report) {
  const ModelConfig& dm = dense.cfg.model;
  SIGMA_CHECK(dm.rre_layers == 0,
              "{} is not a dense model (model.rre_layers = {}): inherit starts from a dense "
              "checkpoint", dense.dir, dm.rre_layers);
  ModelConfig& sm = sparse.model;
  check_same("d_model", dm.d_model, sm.d_model, dense.dir);
  check_same("layers", dm.layers, sm.layers, dense.dir);
  check_same("heads", dm.heads, sm.heads, dense.dir);
  check_same("context", dm.context, sm.context, dense.dir);

  // Vocabulary: the dense one, or the grown tokenizer's mapped by string.
  std::vector<std::vector<int64_t>> map;  // new id -> dense ids to average (none: slot mean)
  std::string tokenizer = dense.tokenizer;
  if (!opt.tokenizer.empty()) {
    SIGMA_CHECK(!dense.tokenizer.empty(),
                "the dense checkpoint {} holds no tokenizer, so its rows cannot be mapped by "
                "string to {}", dense.dir, opt.tokenizer);
    const auto old_tok = data::Tokenizer::load(dense.tokenizer);
    const auto new_tok = data::Tokenizer::load(opt.tokenizer);
    SIGMA_CHECK(int64_t(old_tok.vocab_size()) <= dm.vocab,
                "{}: its tokenizer has {} ids but model.vocab = {}", dense.dir,
                old_tok.vocab_size(), dm.vocab);
    map = map_vocab(old_tok, new_tok, opt.tokenizer);
    if (sm.vocab == 0) sm.vocab = int(new_tok.vocab_size());
    SIGMA_CHECK(sm.vocab >= int(new_tok.vocab_size()),
                "model.vocab = {} is smaller than the tokenizer {} ({} ids)", sm.vocab,
                opt.tokenizer, new_tok.vocab_size());
    map.resize(size_t(sm.vocab));  // ids past the tokenizer: no string, the slot's mean row
    tokenizer = opt.tokenizer;
  } else {
    if (sm.vocab == 0) sm.vocab = dm.vocab;
    SIGMA_CHECK(sm.vocab == dm.vocab,
                "model.vocab = {} but the dense model has {}: a new vocabulary needs --tokenizer",
                sm.vocab, dm.vocab);
    map.resize(size_t(sm.vocab));
    for (int64_t i = 0; i < sm.vocab; ++i) map[size_t(i)] = {i};
  }
  if (sm.domains.empty()) bind_model_to_data(sm, *make_data_source(sparse));
  sm.validate();
  SIGMA_CHECK(sm.rre_layers == 0 || sm.gated() || sm.routing == "random",
              "model.routing = '{}' needs token counts per group; inherit builds random tables "
              "(use model.routing = random)", sm.routing);

  const int64_t d = sm.d_model, V = sm.vocab, Vd = dm.vocab;
  const uint64_t seed = sparse.train.seed;  // learned gates only
  NamedModel out;
  out.tokenizer = tokenizer;
  ParamSet ps;
  register_params(ps, sm);
  for (Param& p : ps.all()) {
    Tensor t = Tensor::f32(p.value.shape());
    float* dst = t.f();
    if (p.name == names::kTokens) {
      // A new id's row is the mean of the dense rows of the pieces that spelled it, in the
      // same slot: its input keeps the meaning the dense model gave those bytes, and its
      // logit in the tied head is the mean of theirs (docs/surgery.md, "Growing the tokenizer").
      const Tensor& e = dense.tensors.at(names::kTokens);
      InheritReport rep{V, 0, 0, 0};
      std::vector<double> acc(static_cast<size_t>(d)), mean(static_cast<size_t>(d));
      for (int slot = 0; slot < sm.slots; ++slot) {
        const int src = slot < dm.slots ? slot : 0;  // extra slots copy dense slot 0
        const float* table = e.f() + src * Vd * d;
        std::fill(mean.begin(), mean.end(), 0.0);
        for (int64_t x = 0; x < Vd; ++x)
          for (int64_t j = 0; j < d; ++j) mean[size_t(j)] += table[x * d + j];
        for (double& m : mean) m /= double(Vd);
        for (int64_t x = 0; x < V; ++x) {
          float* row = dst + (slot * V + x) * d;
          const std::vector<int64_t>& from = map[size_t(x)];
          if (from.size() == 1) {
            std::memcpy(row, table + from[0] * d, size_t(d) * 4);
            rep.kept_rows += slot == 0;
            continue;
          }
          if (from.empty()) {
            for (int64_t j = 0; j < d; ++j) row[j] = float(mean[size_t(j)]);
            rep.mean_rows += slot == 0;
            continue;
          }
          std::fill(acc.begin(), acc.end(), 0.0);
          for (int64_t f : from)
            for (int64_t j = 0; j < d; ++j) acc[size_t(j)] += table[f * d + j];
          for (int64_t j = 0; j < d; ++j) row[j] = float(acc[size_t(j)] / double(from.size()));
          rep.composed_rows += slot == 0;
        }
      }
      if (report) *report = rep;
    } else if (names::is_gate(p.name)) {
      // Learned-gate baseline: the gate has no dense counterpart; fresh N(0, init_std).
      const uint64_t stream = stream_of(p.name.c_str());
      for (int64_t i = 0; i < t.numel(); ++i) dst[i] = sm.init_std * rng_normal(seed, stream, i);
    } else if (names::is_expert(p.name)) {
      // blocks.l.rre.G.leaf [K, ...] <- K copies of blocks.l.ffn.leaf
      const std::string src = names::ffn(names::block_of(p.name), names::leaf_of(p.name));
      const Tensor& f = dense.tensors.at(src);
      const int64_t K = t.dim(0);
      SIGMA_CHECK(f.numel() * K == t.numel(), "{}: '{}' is {} but '{}' needs {} experts of it",
                  dense.dir, src, shape_str(f.shape()), p.name, K);
      for (int64_t k = 0; k < K; ++k) std::memcpy(dst + k * f.numel(), f.f(), f.nbytes());
    } else {
      auto it = dense.tensors.find(p.name);
      SIGMA_CHECK(it != dense.tensors.end(), "{}: tensor '{}' is missing", dense.dir, p.name);
      SIGMA_CHECK(it->second.shape() == t.shape(), "{}: tensor '{}' is {} but the sparse model "
                  "needs {}", dense.dir, p.name, shape_str(it->second.shape()), shape_str(t.shape()));
      std::memcpy(dst, it->second.f(), t.nbytes());
    }
    out.tensors.emplace(p.name, std::move(t));
  }
  BufferSet bs;
  register_buffers(bs, sm);
  for (const Buffer& b : bs.all()) {
    const std::string g = names::group_of(b.name);
    const auto table = random_routing_table(V, sm.groups[size_t(sm.group_index(g))].experts,
                                            sm.routing_seed, names::block_of(b.name), g);
    Tensor t(DType::I32, {V});
    std::memcpy(t.bytes(), table.data(), t.nbytes());
    out.tensors.emplace(b.name, std::move(t));
  }
  out.cfg = std::move(sparse);
  return out;
}

}  // namespace sigma::surgery
