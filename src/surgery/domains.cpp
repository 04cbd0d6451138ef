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

NamedModel add_domain(const NamedModel& m, const AddDomain& spec) {
  const ModelConfig& c = m.cfg.model;
  for (const DomainSpec& d : c.domains)
    SIGMA_CHECK(d.name != spec.name, "domain '{}' already exists: choose another --name", spec.name);
  for (const GroupSpec& g : c.groups)
    SIGMA_CHECK(g.name != spec.name, "an expert group named '{}' already exists: the new domain's "
                "group takes its name, so choose another --name", spec.name);
  SIGMA_CHECK(c.rre_layers > 0, "the model has no expert blocks (model.rre_layers = 0): inherit "
              "it into a sparse model first (sigma inherit)");
  SIGMA_CHECK(spec.experts >= 0, "--experts must be positive (got {})", spec.experts);

  const bool from_group = spec.init_from != "dense" && spec.init_from != "random";
  int src_g = -1, src_k = 0, src_slot = 0;
  if (from_group) {
    try {
      src_g = c.group_index(spec.init_from);
    } catch (const Error& e) {
      fail("--init-from '{}': not 'dense', 'random' or an expert group ({})", spec.init_from,
           e.what());
    }
    src_k = c.groups[size_t(src_g)].experts;
    for (const DomainSpec& d : c.domains)
      if (d.group == spec.init_from) {
        src_slot = d.slot;
        break;
      }
  }
  const int K = spec.experts > 0 ? spec.experts : src_k;
  SIGMA_CHECK(K > 0, "--experts is needed with --init-from {}", spec.init_from);
  NamedModel dense;
  if (spec.init_from == "dense") {
    SIGMA_CHECK(!spec.dense.empty(), "--init-from dense needs --dense DENSE_CKPT (the dense model "
                "whose FFN of block l starts every expert of block l)");
    dense = read_model(spec.dense);
    const ModelConfig& dm = dense.cfg.model;
    SIGMA_CHECK(dm.rre_layers == 0, "{} is not a dense model (model.rre_layers = {})", dense.dir,
                dm.rre_layers);
    SIGMA_CHECK(dm.d_model == c.d_model && dm.layers == c.layers,
                "the dense model {} has d_model {} and {} layers but this model has {} and {}",
                dense.dir, dm.d_model, dm.layers, c.d_model, c.layers);
  }

  NamedModel out;
  out.cfg = m.cfg;
  out.tokenizer = m.tokenizer;
  ModelConfig& nc = out.cfg.model;
  nc.groups.push_back({spec.name, K});
  nc.domains.push_back({spec.name, spec.name, c.slots});
  nc.slots = c.slots + 1;
  nc.validate();  // the name must also be a valid group name

  const int64_t V = c.vocab, dm = c.d_model, f = c.ffn();
  const uint64_t seed = m.cfg.train.seed;
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
  for (int l = c.first_rre_block(); l < c.layers; ++l) {
    for (auto [leaf, rows, cols] : {std::tuple{names::kWIn, dm, f}, {names::kBIn, int64_t(1), f},
                                    {names::kWOut, f, dm}, {names::kBOut, int64_t(1), dm}}) {
      const std::string name = names::expert(l, spec.name, leaf);
      const int64_t per = rows * cols;
      Shape shape = rows == 1 ? Shape{K, cols} : Shape{K, rows, cols};
      Tensor t = Tensor::f32(shape);
      for (int64_t k = 0; k < K; ++k) {
        float* dst = t.f() + k * per;
        if (from_group) {
          const Tensor& s = m.tensors.at(names::expert(l, spec.init_from, leaf));
          std::memcpy(dst, s.f() + (k % src_k) * per, size_t(per) * 4);
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
      out.tensors.emplace(name, std::move(t));
    }
    if (c.gated()) {  // gate columns follow their experts
      Tensor gw = Tensor::f32({dm, K});
      const std::string gname = names::gate(l, spec.name);
      for (int64_t i = 0; i < dm; ++i)
        for (int64_t k = 0; k < K; ++k)
          gw.f()[i * K + k] =
              from_group ? m.tensors.at(names::gate(l, spec.init_from)).f()[i * src_k + k % src_k]
                         : c.init_std * rng_normal(seed, stream_of(gname.c_str()), i * K + k);
      out.tensors.emplace(gname, std::move(gw));
      continue;
    }
    Tensor table(DType::I32, {V});
    if (from_group && K == src_k) {
      std::memcpy(table.bytes(), m.tensors.at(names::routing(l, spec.init_from)).bytes(), table.nbytes());
    } else {
      const auto r = random_routing_table(V, K, c.routing_seed, l, spec.name);
      std::memcpy(table.bytes(), r.data(), table.nbytes());
    }
    out.tensors.emplace(names::routing(l, spec.name), std::move(table));
  }
  return out;
}

}  // namespace sigma::surgery
