#include "data/sampler.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "core/rng.h"

namespace sigma::data {

using nlohmann::json;

SamplerConfig SamplerConfig::from_json(const json& j, const std::string& where) {
  SIGMA_CHECK(j.is_object(), "{}: must be an object", where);
  SamplerConfig c;
  for (auto& [k, v] : j.items())
    SIGMA_CHECK(k == "seed" || k == "stages" || k == "one_domain_per_batch",
                "{}: unknown key \"{}\" (known: seed, stages, one_domain_per_batch)", where, k);
  if (j.contains("one_domain_per_batch")) {
    SIGMA_CHECK(j["one_domain_per_batch"].is_boolean(), "{}.one_domain_per_batch: must be true or "
                "false", where);
    c.one_domain_per_batch = j["one_domain_per_batch"].get<bool>();
  }
  if (j.contains("seed")) {
    SIGMA_CHECK(j["seed"].is_number_unsigned(), "{}.seed: must be a non-negative integer", where);
    c.seed = j["seed"].get<uint64_t>();
  }
  if (!j.contains("stages")) return c;
  SIGMA_CHECK(j["stages"].is_array(), "{}.stages: must be an array", where);
  for (size_t i = 0; i < j["stages"].size(); ++i) {
    const json& s = j["stages"][i];
    std::string at = fmt::format("{}.stages[{}]", where, i);
    SIGMA_CHECK(s.is_object(), "{}: must be an object", at);
    SIGMA_CHECK(!(s.contains("weights") && s.contains("domains")),
                "{}: give \"weights\" or \"domains\", not both", at);
    Stage st;
    for (auto& [k, v] : s.items()) {
      if (k == "steps") {
        SIGMA_CHECK(v.is_number_unsigned(), "{}.steps: must be a non-negative integer", at);
        st.steps = v.get<uint64_t>();
      } else if (k == "weights") {
        SIGMA_CHECK(v.is_object() && !v.empty(), "{}.weights: must map domain names to weights", at);
        st.by_tokens = false;
        for (auto& [name, w] : v.items()) {
          SIGMA_CHECK(w.is_number() && w.get<double>() >= 0, "{}.weights.{}: must be a number >= 0",
                      at, name);
          st.weights.emplace_back(name, w.get<double>());
        }
      } else if (k == "domains") {
        SIGMA_CHECK(v.is_array(), "{}.domains: must be an array of domain names", at);
        for (auto& name : v) {
          SIGMA_CHECK(name.is_string(), "{}.domains: must be an array of domain names", at);
          st.domains.push_back(name.get<std::string>());
        }
      } else {
        fail("{}: unknown key \"{}\" (known: steps, weights, domains)", at, k);
      }
    }
    c.stages.push_back(std::move(st));
  }
  return c;
}

json SamplerConfig::to_json() const {
  json stages = json::array();
  for (auto& s : this->stages) {
    json o = {{"steps", s.steps}};
    if (!s.by_tokens) {
      o["weights"] = json::object();
      for (auto& [n, w] : s.weights) o["weights"][n] = w;
    } else if (!s.domains.empty()) {
      o["domains"] = s.domains;
    }
    stages.push_back(std::move(o));
  }
  return {{"seed", seed}, {"stages", std::move(stages)}, {"one_domain_per_batch", one_domain_per_batch}};
}

Sampler::Sampler(SamplerConfig cfg, std::vector<std::string> names, std::vector<uint64_t> items,
                 std::vector<uint64_t> tokens)
    : cfg_(std::move(cfg)), names_(std::move(names)), items_(std::move(items)) {
  const size_t n = names_.size();
  SIGMA_CHECK(n > 0 && items_.size() == n && tokens.size() == n, "sampler: needs one item and token "
              "count per domain");
  if (cfg_.stages.empty()) cfg_.stages.push_back(Stage{});
  auto index_of = [&](const std::string& name, size_t stage) -> size_t {
    auto it = std::find(names_.begin(), names_.end(), name);
    SIGMA_CHECK(it != names_.end(), "sampler: stage {} names domain '{}', which the data does not "
                "have (it has: {}); data.sampler's stages must name the data's domains. A run on "
                "other data than the config's (e.g. a resumed curriculum checkpoint on one "
                "domain's shards) sets data.sampler to {{}} (all domains by token count) or to "
                "stages of its own domains: --set 'data.sampler={{}}'", stage, name,
                fmt::join(names_, ", "));
    return it - names_.begin();
  };
  uint64_t end = 0;
  for (size_t s = 0; s < cfg_.stages.size(); ++s) {
    const Stage& st = cfg_.stages[s];
    bool last = s + 1 == cfg_.stages.size();
    SIGMA_CHECK(st.steps > 0 || last, "sampler: stage {} has no \"steps\"; only the last stage may "
                "run until the end", s);
    std::vector<double> w(n, 0.0);
    if (!st.by_tokens) {
      for (auto& [name, x] : st.weights) w[index_of(name, s)] = x;
    } else {
      for (size_t d = 0; d < n; ++d) w[d] = st.domains.empty() ? double(tokens[d]) : 0.0;
      for (auto& name : st.domains) w[index_of(name, s)] = double(tokens[index_of(name, s)]);
    }
    for (size_t d = 0; d < n; ++d)
      SIGMA_CHECK(w[d] == 0 || items_[d] > 0, "sampler: stage {} draws from domain '{}', which has "
                  "nothing to draw (too few tokens for one window?)", s, names_[d]);
    double total = std::accumulate(w.begin(), w.end(), 0.0);
    SIGMA_CHECK(total > 0, "sampler: stage {} has no domain with a positive weight and data", s);
    std::vector<double> cum(n);
    double run = 0;
    for (size_t d = 0; d < n; ++d) {
      w[d] /= total;
      run += w[d];
      cum[d] = run;
    }
    cum[n - 1] = 1.0;  // so a draw in [0, 1) always lands
    prob_.push_back(std::move(w));
    cum_.push_back(std::move(cum));
    SIGMA_CHECK(cfg_.batches_per_step >= 1, "sampler: batches_per_step must be >= 1");
    end = st.steps == 0 ? UINT64_MAX : end + st.steps * cfg_.batches_per_step;
    stage_end_.push_back(end);
  }
  epoch_.assign(n, 0);
  pos_.assign(n, 0);
  perm_.resize(n);
  for (uint32_t d = 0; d < n; ++d) {
    SIGMA_CHECK(items_[d] < (1ull << 32), "sampler: domain '{}' has more than 2^32 items", names_[d]);
    if (items_[d] > 0) shuffle(d);
  }
}

size_t Sampler::stage_at(uint64_t batch) const {
  for (size_t s = 0; s < stage_end_.size(); ++s)
    if (batch < stage_end_[s]) return s;
  return stage_end_.size() - 1;  // all stages finite: the last one continues
}

// Fisher-Yates over the domain's items, seeded by (seed, domain name, epoch).
void Sampler::shuffle(uint32_t d) {
  auto& p = perm_[d];
  p.resize(items_[d]);
  std::iota(p.begin(), p.end(), 0u);
  Rng r(cfg_.seed, mix64(stream_of(names_[d].c_str()) ^ epoch_[d]));
  for (size_t i = p.size(); i > 1; --i) std::swap(p[i - 1], p[r.below(static_cast<uint32_t>(i))]);
}

uint64_t Sampler::next_item(uint32_t d) {
  if (pos_[d] == items_[d]) {
    ++epoch_[d];
    pos_[d] = 0;
    shuffle(d);
  }
  return perm_[d][pos_[d]++];
}

void Sampler::restrict_batches(std::vector<std::vector<uint32_t>> allowed) {
  for (const auto& a : allowed) {
    SIGMA_CHECK(!a.empty(), "sampler: a batch slot allows no domain");
    for (uint32_t d : a) SIGMA_CHECK(d < names_.size(), "sampler: no domain {}", d);
  }
  allowed_ = std::move(allowed);
}

void Sampler::next_batch(uint32_t rows, std::vector<Pick>& out) {
  static const uint64_t kStream = stream_of("sampler.domain");
  const size_t stage = stage_at(step_);
  const auto& cum = cum_[stage];
  const std::vector<uint32_t>* allowed = allowed_.empty() ? nullptr : &allowed_[step_ % allowed_.size()];
  double allowed_mass = 0;
  for (size_t i = 0; allowed && i < allowed->size(); ++i) allowed_mass += prob_[stage][(*allowed)[i]];
  SIGMA_CHECK(!allowed || allowed_mass > 0, "sampler: batch {} may draw only from domains the "
              "current stage gives no weight (the micro-batch's expert group has no data in it)",
              step_);
  out.resize(rows);
  for (uint32_t r = 0; r < rows; ++r) {
    // 53-bit uniform from (seed, step, row): the draw does not depend on the batch size. One
    // domain per batch: every row takes row 0's draw.
    const uint32_t draw = cfg_.one_domain_per_batch ? 0 : r;
    double u = static_cast<double>(rng_u64(cfg_.seed, mix64(kStream ^ step_), draw) >> 11) * 0x1p-53;
    uint32_t d = static_cast<uint32_t>(std::upper_bound(cum.begin(), cum.end(), u) - cum.begin());
    if (allowed) {  // the same draw over the allowed domains' share of the weights
      double at = u * allowed_mass;
      for (uint32_t a : *allowed) {
        if (prob_[stage][a] <= 0) continue;
        d = a;  // the last with weight, should rounding leave `at` a hair above zero
        if ((at -= prob_[stage][a]) < 0) break;
      }
    }
    out[r] = {d, next_item(d)};
  }
  ++step_;
}

json Sampler::cursor() const {
  json doms = json::object();
  for (size_t d = 0; d < names_.size(); ++d)
    doms[names_[d]] = {{"epoch", epoch_[d]}, {"pos", pos_[d]}, {"items", items_[d]}};
  return {{"seed", cfg_.seed}, {"step", step_}, {"domains", std::move(doms)}};
}

void Sampler::restore(const json& c) {
  try {
    SIGMA_CHECK(c.at("seed").get<uint64_t>() == cfg_.seed, "sampler cursor: saved with seed {}, the "
                "config has {}", c.at("seed").get<uint64_t>(), cfg_.seed);
    const json& doms = c.at("domains");
    std::vector<std::string> saved;
    for (const auto& [name, v] : doms.items()) saved.push_back(name);
    SIGMA_CHECK(doms.size() == names_.size(), "sampler cursor: saved for {} domains ({}), the "
                "data has {} ({})", doms.size(), fmt::join(saved, ", "), names_.size(),
                fmt::join(names_, ", "));
    std::vector<uint64_t> epoch(names_.size()), pos(names_.size());
    for (size_t d = 0; d < names_.size(); ++d) {
      SIGMA_CHECK(doms.contains(names_[d]), "sampler cursor: has no domain '{}'", names_[d]);
      const json& e = doms[names_[d]];
      SIGMA_CHECK(e.at("items").get<uint64_t>() == items_[d], "sampler cursor: domain '{}' had {} "
                  "items when saved, the data now has {}", names_[d], e.at("items").get<uint64_t>(),
                  items_[d]);
      epoch[d] = e.at("epoch").get<uint64_t>();
      pos[d] = e.at("pos").get<uint64_t>();
      SIGMA_CHECK(pos[d] <= items_[d], "sampler cursor: domain '{}' position {} is past its {} items",
                  names_[d], pos[d], items_[d]);
    }
    step_ = c.at("step").get<uint64_t>();
    epoch_ = std::move(epoch);
    pos_ = std::move(pos);
  } catch (const json::exception& e) {
    fail("sampler cursor: malformed ({})", e.what());
  }
  for (uint32_t d = 0; d < names_.size(); ++d)
    if (items_[d] > 0) shuffle(d);
}

}  // namespace sigma::data
