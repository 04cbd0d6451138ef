// sigma inherit / extract / domains {list,add,remove}: model surgery on checkpoints (DESIGN §4,
// docs/surgery.md). Each writes a fresh checkpoint root (OUT/step-00000000 + OUT/latest) at
// step 0 that train --resume, generate, eval and inspect accept, or nothing at all.
#include <fmt/format.h>

#include <filesystem>
#include <nlohmann/json.hpp>

#include "command.h"
#include "surgery/surgery.h"
#include "train/checkpoint.h"
#include "io/checkpoint_dir.h"

namespace sigma::cli {
namespace {

using namespace sigma::surgery;

struct SurgeryArgs {
  std::string from, config, out, tokenizer, ckpt, domains, name, init_from, dense;
  std::vector<std::string> sets;
  int experts = 0;
  bool json = false;
};


int64_t param_total(const NamedModel& m) { return count_params(m).total; }

// The sparse config: --config then --set over the defaults, or without --config the dense
// checkpoint's own config (its domains, data and training keys) with the --set keys applied;
// a new tokenizer then decides model.vocab unless --set does.
Config sparse_config(const SurgeryArgs& a, const NamedModel& dense) {
  SIGMA_CHECK(!a.config.empty() || !a.sets.empty(), "inherit needs the sparse model: "
              "--config SPARSE.json and/or --set keys over the dense model's config, e.g. --set "
              "model.rre_layers=2");
  Config c;
  if (a.config.empty()) {
    c = dense.cfg;
    if (!a.tokenizer.empty()) c.model.vocab = 0;
  }
  c.load(a.config, a.sets);
  return c;
}

void run_inherit(const SurgeryArgs& a) {
  NamedModel dense = read_model(a.from);
  Config sparse = sparse_config(a, dense);
  InheritReport rep;
  NamedModel out = inherit(dense, sparse, {a.tokenizer}, &rep);
  out.origin = origin_of("inherit", dense);
  if (!a.tokenizer.empty())
    out.origin["tokenizer"] = std::filesystem::absolute(a.tokenizer).lexically_normal().string();
  const std::string dir = write_model(a.out, out);
  const ModelConfig& c = out.cfg.model;
  fmt::print("inherited {} -> {}: {} parameters (dense {}), {} RRE blocks, {} groups, {} slots\n",
             dense.dir, dir, param_total(out), param_total(dense), c.rre_layers, c.groups.size(),
             c.slots);
  fmt::print("embedding: {} of {} rows kept from the dense model (same string), {} new strings "
             "as the mean of their pieces' dense rows, {} without a string (new controls, ids "
             "past the tokenizer) as the dense table's mean row\n",
             rep.kept_rows, rep.vocab, rep.composed_rows, rep.mean_rows);
}

void print_size(const NamedModel& full, const NamedModel& sub, const std::string& dir,
                const char* what) {
  const int64_t pf = param_total(full), ps = param_total(sub);
  fmt::print("{} -> {}: {} parameters of {} ({:.1f}%), model.safetensors {} of {} bytes\n", what,
             dir, ps, pf, 100.0 * double(ps) / double(pf), checkpoint_model_bytes(dir), checkpoint_model_bytes(full.dir));
}

void run_extract(const SurgeryArgs& a) {
  NamedModel full = read_model(a.ckpt);
  std::vector<std::string> names;
  for (size_t b = 0; b <= a.domains.size();) {
    size_t e = a.domains.find(',', b);
    if (e == std::string::npos) e = a.domains.size();
    if (e > b) names.push_back(a.domains.substr(b, e - b));
    b = e + 1;
  }
  NamedModel sub = extract(full, names);
  sub.origin = origin_of("extract", full, {{"domains", names}});
  const std::string dir = write_model(a.out, sub);
  print_size(full, sub, dir, fmt::format("extracted {}", a.domains).c_str());
}

void run_list(const SurgeryArgs& a) {
  NamedModel m = read_model(a.ckpt);
  const Counts n = count_params(m);
  const ModelConfig& c = m.cfg.model;
  if (a.json) {
    nlohmann::json j{{"checkpoint", m.dir}, {"vocab", c.vocab}, {"slots", c.slots},
                     {"rre_layers", c.rre_layers}, {"parameters", n.total}, {"shared", n.shared},
                     {"per_slot", n.per_slot}};
    j["groups"] = nlohmann::json::array();
    for (const auto& g : n.groups)
      j["groups"].push_back({{"name", g.name}, {"experts", g.experts}, {"params", g.params},
                             {"domains", g.domains}});
    j["domains"] = nlohmann::json::array();
    for (const auto& d : n.domains)
      j["domains"].push_back({{"name", d.name}, {"group", d.group}, {"slot", d.slot},
                              {"params", d.params}});
    fmt::print("{}\n", j.dump(2));
    return;
  }
  fmt::print("{}: {} parameters; shared {} (embedding excluded), {} per slot x {} slots, "
             "{} RRE blocks\n", m.dir, n.total, n.shared, n.per_slot, c.slots, c.rre_layers);
  fmt::print("{:<14} {:>8} {:>12}  {}\n", "group", "experts", "params", "domains");
  for (const auto& g : n.groups)
    fmt::print("{:<14} {:>8} {:>12}  {}\n", g.name, g.experts, g.params, fmt::join(g.domains, ", "));
  fmt::print("{:<14} {:<14} {:>4} {:>12}\n", "domain", "group", "slot", "alone");
  for (const auto& d : n.domains)
    fmt::print("{:<14} {:<14} {:>4} {:>12}\n", d.name, d.group.empty() ? "-" : d.group, d.slot,
               d.params);
}

void run_add(const SurgeryArgs& a) {
  NamedModel m = read_model(a.ckpt);
  NamedModel out = add_domain(m, {a.name, a.init_from, a.experts, a.dense});
  out.origin = origin_of("domains add", m, {{"domain", a.name}, {"init_from", a.init_from}});
  const std::string dir = write_model(a.out, out);
  const auto& g = out.cfg.model.groups.back();
  fmt::print("added domain '{}' -> {}: group '{}' with {} experts (from {}), slot {}; {} "
             "parameters (was {})\n", a.name, dir, g.name, g.experts, a.init_from,
             out.cfg.model.slots - 1, param_total(out), param_total(m));
}

void run_remove(const SurgeryArgs& a) {
  NamedModel m = read_model(a.ckpt);
  NamedModel out = remove_domain(m, a.name);
  out.origin = origin_of("domains remove", m, {{"domain", a.name}});
  const std::string dir = write_model(a.out, out);
  print_size(m, out, dir, fmt::format("removed {}", a.name).c_str());
}

const RegisterCommand reg_surgery([](CLI::App& root) {
  auto a = std::make_shared<SurgeryArgs>();
  CLI::App* c = root.add_subcommand(
      "inherit", "A sparse (RRE) model from a dense checkpoint: experts start as the dense FFN");
  c->add_option("--from", a->from, "Dense checkpoint (or a checkpoints/ root)")->required();
  c->add_option("--config", a->config, "Sparse model's JSON config (default: the dense "
                "checkpoint's config with the --set keys)")->check(CLI::ExistingFile);
  c->add_option("--set", a->sets, "Override a config key: key=value (repeatable), e.g. "
                "model.rre_layers=2");
  c->add_option("--out", a->out, "Output checkpoint root (new or empty)")->required();
  c->add_option("--tokenizer", a->tokenizer,
                "Grown tokenizer: rows mapped by sub-word string; a new string's row is the mean of its "
                "pieces' rows under the dense tokenizer")
      ->check(CLI::ExistingFile);
  c->callback([a] { run_inherit(*a); });

  c = root.add_subcommand("extract", "A standalone model of some domains: shared tensors, their "
                                     "slots, experts and routing tables");
  c->add_option("--ckpt", a->ckpt, fmt::format("Model: {}", kCkptForms))->required();
  c->add_option("--domain", a->domains, "Domain name(s), comma-separated")->required();
  c->add_option("--out", a->out, "Output checkpoint root (new or empty)")->required();
  c->callback([a] { run_extract(*a); });

  CLI::App* dom = root.add_subcommand("domains", "List, add or remove domains of a checkpoint");
  dom->require_subcommand(1);
  c = dom->add_subcommand("list", "Domains, groups, slots, experts and parameter counts");
  c->add_option("--ckpt", a->ckpt, fmt::format("Model: {}", kCkptForms))->required();
  c->add_flag("--json", a->json, "Print JSON");
  c->callback([a] { run_list(*a); });
  c = dom->add_subcommand("add", "A new domain with its own expert group and embedding slot");
  c->add_option("--ckpt", a->ckpt, fmt::format("Model: {}", kCkptForms))->required();
  c->add_option("--name", a->name, "New domain (and its group's) name")->required();
  c->add_option("--init-from", a->init_from, "Expert group to copy, 'dense' or 'random'")->required();
  c->add_option("--experts", a->experts, "Experts K of the new group (default: the source's)")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--dense", a->dense, "Dense checkpoint for --init-from dense");
  c->add_option("--out", a->out, "Output checkpoint root (new or empty)")->required();
  c->callback([a] { run_add(*a); });
  c = dom->add_subcommand("remove", "Drop a domain (and its group and slot when no other uses them)");
  c->add_option("--ckpt", a->ckpt, fmt::format("Model: {}", kCkptForms))->required();
  c->add_option("--name", a->name, "Domain to remove")->required();
  c->add_option("--out", a->out, "Output checkpoint root (new or empty)")->required();
  c->callback([a] { run_remove(*a); });
});

}  // namespace
}  // namespace sigma::cli
