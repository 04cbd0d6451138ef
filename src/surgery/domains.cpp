// Extract, remove and add domains (DESIGN §4) on named tensors. Extract keeps tensors bit for
// bit: the sub-model reads the same rows, experts and tables as the full model does for its
// domains, so on their inputs it computes the same bits.
#include <algorithm>
#include <cmath>
#include <tuple>
#include <cstring>
#include <map>
#include <set>

#include "core/rng.h"
#include "model/names.h"
#include "model/routing.h"
#include "surgery/surgery.h"

namespace sigma::surgery {

NamedModel extract(const NamedModel& m, const std::vector<std::string>& names) {
  const ModelConfig& c = m.cfg.model;
  if (names.empty()) c.domain_index("");  // throws naming the known domains
  std::set<std::string> want;
  for (const std::string& n : names) {
    c.domain_index(n);  // throws naming the known domains
    SIGMA_CHECK(want.insert(n).second, "domain '{}' is named twice", n);
  }
  // Kept domains in the model's order; their groups in config order; their slots renumbered.
  std::set<std::string> groups;
  std::set<int> slots;
  for (const DomainSpec& d : c.domains)
    if (want.count(d.name)) groups.insert(d.group), slots.insert(d.slot);
  std::map<int, int> new_slot;
  for (int s : slots) new_slot.emplace(s, int(new_slot.size()));

  NamedModel out;
  out.cfg = m.cfg;
  out.tokenizer = m.tokenizer;
  ModelConfig& nc = out.cfg.model;
  nc.domains.clear();
  for (const DomainSpec& d : c.domains)
    if (want.count(d.name)) nc.domains.push_back({d.name, d.group, new_slot.at(d.slot)});
  nc.groups.clear();
  for (const GroupSpec& g : c.groups)
    if (groups.count(g.name)) nc.groups.push_back(g);
  nc.slots = int(slots.size());

  const int64_t V = c.vocab, d = c.d_model;
  for (const auto& [name, t] : m.tensors) {
    if (name == names::kTokens) {
      Tensor e = Tensor::f32({nc.slots * V, d});
      for (auto [from, to] : new_slot)
        std::memcpy(e.f() + to * V * d, t.f() + from * V * d, size_t(V * d) * 4);
      out.tensors.emplace(name, std::move(e));
      continue;
    }
    const std::string g = names::group_of(name);
    if (g.empty() || groups.count(g)) out.tensors.emplace(name, t.clone());
  }
  nc.validate();
  return out;
}

NamedModel remove_domain(const NamedModel& m, const std::string& name) {
  const ModelConfig& c = m.cfg.model;
  c.domain_index(name);
  SIGMA_CHECK(c.domains.size() > 1, "cannot remove domain '{}': it is the model's last domain",
              name);
  std::vector<std::string> rest;
  for (const DomainSpec& d : c.domains)
    if (d.name != name) rest.push_back(d.name);
  return extract(m, rest);
}

namespace {

// The new name must be free as a domain and as a group, and the model must have expert blocks.
void check_new_domain(const ModelConfig& c, const AddDomain& spec) {
  for (const DomainSpec& d : c.domains)
    SIGMA_CHECK(d.name != spec.name, "domain '{}' already exists: choose another --name", spec.name);
  for (const GroupSpec& g : c.groups)
    SIGMA_CHECK(g.name != spec.name, "an expert group named '{}' already exists: the new domain's "
                "group takes its name, so choose another --name", spec.name);
  SIGMA_CHECK(c.rre_layers > 0, "the model has no expert blocks (model.rre_layers = 0): inherit "
              "it into a sparse model first (sigma inherit)");
  SIGMA_CHECK(spec.experts >= 0, "--experts must be positive (got {})", spec.experts);
}

// Where --init-from points when it names an expert group.
struct SourceGroup {
  bool used = false;  // --init-from is a group (not dense or random)
  int experts = 0;    // its K
  int slot = 0;       // embedding slot of its first domain; slot 0 when none (or not a group)
};

SourceGroup find_source_group(const ModelConfig& c, const AddDomain& spec) {
  SourceGroup src;
  src.used = spec.init_from != "dense" && spec.init_from != "random";
  if (!src.used) return src;
  int g = -1;
  try {
    g = c.group_index(spec.init_from);
  } catch (const Error& e) {
    fail("--init-from '{}': not 'dense', 'random' or an expert group ({})", spec.init_from,
         e.what());
  }
  src.experts = c.groups[size_t(g)].experts;
  for (const DomainSpec& d : c.domains)
    if (d.group == spec.init_from) {
      src.slot = d.slot;
      break;
    }
  return src;
}

// --init-from dense: the dense model whose FFNs start the experts; same width and depth as c.
NamedModel read_dense_source(const ModelConfig& c, const AddDomain& spec) {
  SIGMA_CHECK(!spec.dense.empty(), "--init-from dense needs --dense DENSE_CKPT (the dense model "
              "whose FFN of block l starts every expert of block l)");
  NamedModel dense = read_model(spec.dense);
  const ModelConfig& dm = dense.cfg.model;
  SIGMA_CHECK(dm.rre_layers == 0, "{} is not a dense model (model.rre_layers = {})", dense.dir,
              dm.rre_layers);
  SIGMA_CHECK(dm.d_model == c.d_model && dm.layers == c.layers,
              "the dense model {} has d_model {} and {} layers but this model has {} and {}",
              dense.dir, dm.d_model, dm.layers, c.d_model, c.layers);
  return dense;
}

// m with the new domain and its group (K experts) in the config, every tensor copied, and a new
// last embedding slot that copies slot `src_slot`.
NamedModel with_new_slot(const NamedModel& m, const AddDomain& spec, int K, int src_slot) {
  const ModelConfig& c = m.cfg.model;
  NamedModel out;
  out.cfg = m.cfg;
  out.tokenizer = m.tokenizer;
  ModelConfig& nc = out.cfg.model;
  nc.groups.push_back({spec.name, K});
  nc.domains.push_back({spec.name, spec.name, c.slots});
  nc.slots = c.slots + 1;
  nc.validate();  // the name must also be a valid group name

  const int64_t V = c.vocab, dm = c.d_model;
  for (const auto& [name, t] : m.tensors) {
    if (name != names::kTokens) {
      out.tensors.emplace(name, t.clone());
      continue;
    }
    Tensor e = Tensor::f32({nc.slots * V, dm});
    std::memcpy(e.f(), t.f(), t.nbytes());
    std::memcpy(e.f() + c.slots * V * dm, t.f() + src_slot * V * dm, size_t(V * dm) * 4);
    out.tensors.emplace(name, std::move(e));
  }
  return out;
}

// The new group's tensors of one block, made from --init-from: a group (expert k copies source
// expert k mod K_src), the dense model's FFN, or random.
struct NewGroup {
  const NamedModel& m;
  const AddDomain& spec;
  const SourceGroup& src;
  const NamedModel& dense;  // --init-from dense only
  int K;

  // Expert leaf `name` of block l, [K, rows, cols] ([K, cols] for a bias).
  Tensor experts(int l, const char* leaf, const std::string& name, int64_t rows, int64_t cols) const {
    const ModelConfig& c = m.cfg.model;
    const uint64_t seed = m.cfg.train.seed;
    const int64_t per = rows * cols;
    Shape shape = rows == 1 ? Shape{K, cols} : Shape{K, rows, cols};
    Tensor t = Tensor::f32(shape);
    for (int64_t k = 0; k < K; ++k) {
      float* dst = t.f() + k * per;
      if (src.used) {
        const Tensor& s = m.tensors.at(names::expert(l, spec.init_from, leaf));
        std::memcpy(dst, s.f() + (k % src.experts) * per, size_t(per) * 4);
      } else if (spec.init_from == "dense") {
        std::memcpy(dst, dense.tensors.at(names::ffn(l, leaf)).f(), size_t(per) * 4);
      } else {  // random: as a fresh model initialises experts (biases zero)
        if (rows == 1) continue;
        const float std = names::is_residual_projection(name)
                              ? c.init_std / std::sqrt(2.0f * c.layers) : c.init_std;
        const uint64_t stream = stream_of(names::expert_slice(name, k).c_str());
        for (int64_t i = 0; i < per; ++i) dst[i] = std * rng_normal(seed, stream, i);
      }
    }
    return t;
  }

  // Gate `gname` of block l, [d_model, K]: gate columns follow their experts.
  Tensor gate(int l, const std::string& gname) const {
    const ModelConfig& c = m.cfg.model;
    const uint64_t seed = m.cfg.train.seed;
    const int64_t dm = c.d_model;
    const int src_k = src.experts;
    Tensor gw = Tensor::f32({dm, K});
    for (int64_t i = 0; i < dm; ++i)
      for (int64_t k = 0; k < K; ++k)
        gw.f()[i * K + k] =
            src.used ? m.tensors.at(names::gate(l, spec.init_from)).f()[i * src_k + k % src_k]
                     : c.init_std * rng_normal(seed, stream_of(gname.c_str()), i * K + k);
    return gw;
  }

  // Routing table of block l, [V]: the source group's when K matches, else from routing_seed.
  Tensor routing_table(int l) const {
    const ModelConfig& c = m.cfg.model;
    const int64_t V = c.vocab;
    Tensor table(DType::I32, {V});
    if (src.used && K == src.experts) {
      std::memcpy(table.bytes(), m.tensors.at(names::routing(l, spec.init_from)).bytes(), table.nbytes());
    } else {
      const auto r = random_routing_table(V, K, c.routing_seed, l, spec.name);
      std::memcpy(table.bytes(), r.data(), table.nbytes());
    }
    return table;
  }
};

}  // namespace

NamedModel add_domain(const NamedModel& m, const AddDomain& spec) {
  const ModelConfig& c = m.cfg.model;
  check_new_domain(c, spec);
  const SourceGroup src = find_source_group(c, spec);
  const int K = spec.experts > 0 ? spec.experts : src.experts;
  SIGMA_CHECK(K > 0, "--experts is needed with --init-from {}", spec.init_from);
  const NamedModel dense = spec.init_from == "dense" ? read_dense_source(c, spec) : NamedModel{};

  NamedModel out = with_new_slot(m, spec, K, src.slot);
  const NewGroup group{m, spec, src, dense, K};
  const int64_t dm = c.d_model, f = c.ffn();
  for (int l = c.first_rre_block(); l < c.layers; ++l) {
    for (auto [leaf, rows, cols] : {std::tuple{names::kWIn, dm, f}, {names::kBIn, int64_t(1), f},
                                    {names::kWOut, f, dm}, {names::kBOut, int64_t(1), dm}}) {
      const std::string name = names::expert(l, spec.name, leaf);
      out.tensors.emplace(name, group.experts(l, leaf, name, rows, cols));
    }
    if (c.gated()) {
      const std::string gname = names::gate(l, spec.name);
      out.tensors.emplace(gname, group.gate(l, gname));
    } else {
      out.tensors.emplace(names::routing(l, spec.name), group.routing_table(l));
    }
  }
  return out;
}

}  // namespace sigma::surgery
