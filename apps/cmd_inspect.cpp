// sigma inspect: what a checkpoint holds — parameters in total and active per token, the
// dense / RRE block layout, experts per group, and how evenly each routing table deals the
// vocabulary to its experts.
#include <fmt/format.h>
#include <xxhash.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "command.h"
#include "model/names.h"
#include "io/checkpoint_dir.h"
#include "io/checkpoint_shards.h"
#include "run/checkpoint.h"

namespace sigma::cli {
namespace {

struct InspectArgs {
  std::string ckpt;
  bool json = false;
  bool tensors = false;
};

nlohmann::json describe(const Model& m, const CheckpointInfo& info) {
  const ModelConfig& c = m.config();
  int64_t expert_params = 0;
  for (const Param& p : m.params().all())
    if (p.expert) expert_params += p.value.numel();
  const int64_t d = c.d_model, f = c.ffn();
  nlohmann::json j;
  j["checkpoint"] = info.dir;
  j["step"] = info.state.step;
  j["tokens"] = info.state.tokens;
  j["origin"] = info.state.origin;  // null: trained from scratch
  // A surgery output holds no optimizer state: training it starts a fresh AdamW state.
  j["optimizer"] = std::filesystem::exists(info.dir + "/" + kOptimizerFile) ||
                           (is_sharded_checkpoint(info.dir) && !sharded_files(info.dir, true).empty())
                       ? "saved"
                       : "none";
  j["parameters"] = {{"total", m.params().numel()},
                     {"active_per_token", m.active_params_per_token()},
                     {"shared", m.params().numel() - expert_params},
                     {"experts", expert_params},
                     {"per_expert", 2 * d * f + f + d}};
  j["vocab"] = c.vocab;
  j["slots"] = c.slots;
  j["layers"] = c.layers;
  j["rre_layers"] = c.rre_layers;
  std::vector<int> rre_blocks;
  for (int l = c.first_rre_block(); l < c.layers; ++l) rre_blocks.push_back(l);
  j["rre_blocks"] = rre_blocks;
  j["router"] = c.router;  // rre, or the learned-gate baseline top1 / top2
  j["routing"] = c.routing;
  j["routing_seed"] = c.routing_seed;
  j["groups"] = nlohmann::json::array();
  for (const GroupSpec& g : c.groups) {
    std::vector<std::string> domains;
    for (const DomainSpec& dom : c.domains)
      if (dom.group == g.name) domains.push_back(dom.name);
    j["groups"].push_back({{"name", g.name}, {"experts", g.experts}, {"domains", domains}});
  }
  // Balance of each table: token ids per expert (a random table holds floor or ceil of V/K).
  j["tables"] = nlohmann::json::array();
  for (int l = c.first_rre_block(); l < c.layers && c.rre_layers > 0 && !c.gated(); ++l)
    for (const GroupSpec& g : c.groups) {
      const Tensor& t = m.buffers().at(names::routing(l, g.name)).value;
      std::vector<int64_t> ids(size_t(g.experts), 0);
      for (int64_t i = 0; i < t.numel(); ++i) ++ids[size_t(t.data<int32_t>()[i])];
      const auto [lo, hi] = std::minmax_element(ids.begin(), ids.end());
      j["tables"].push_back({{"name", names::routing(l, g.name)},
                             {"block", l},
                             {"group", g.name},
                             {"ids_per_expert", ids},
                             {"min", *lo},
                             {"max", *hi},
                             {"imbalance", double(*hi) * double(g.experts) / double(c.vocab)}});
    }
  return j;
}

void print_text(const nlohmann::json& j) {
  const auto& p = j["parameters"];
  fmt::print("checkpoint  {} (step {}, {} tokens{})\n", j["checkpoint"].get<std::string>(),
             j["step"].get<int64_t>(), j["tokens"].get<int64_t>(),
             j["optimizer"] == "none" ? "; no optimizer state: training starts a fresh one" : "");
  // The chain of surgery steps it came from, newest first.
  for (const nlohmann::json* o = &j["origin"]; o->is_object(); o = &(*o)["origin"]) {
    std::string what;
    for (const char* k : {"domains", "domain", "init_from", "tokenizer"})
      if (o->contains(k)) what += fmt::format(", {} {}", k, (*o)[k].is_string() ? (*o)[k].get<std::string>() : (*o)[k].dump());
    fmt::print("origin      {} of {} (step {}, {} tokens{})\n", (*o)["command"].get<std::string>(),
               (*o)["checkpoint"].get<std::string>(), (*o)["step"].get<int64_t>(),
               (*o)["tokens"].get<int64_t>(), what);
    if (!o->contains("origin")) break;
  }
  fmt::print("parameters  {} total, {} active per token ({} shared, {} in experts, {} per "
             "expert)\n", p["total"].get<int64_t>(), p["active_per_token"].get<int64_t>(),
             p["shared"].get<int64_t>(), p["experts"].get<int64_t>(),
             p["per_expert"].get<int64_t>());
  fmt::print("blocks      {} ({} dense, RRE: {})\n", j["layers"].get<int>(),
             j["layers"].get<int>() - j["rre_layers"].get<int>(),
             j["rre_layers"].get<int>() ? fmt::format("{}", fmt::join(j["rre_blocks"].get<std::vector<int>>(), ", "))
                                        : std::string("none"));
  if (j["groups"].empty()) return;
  if (j["router"] == "rre")
    fmt::print("routing     {} tables (seed {})\n", j["routing"].get<std::string>(),
               j["routing_seed"].get<uint64_t>());
  else
    fmt::print("routing     learned {} gate\n", j["router"].get<std::string>());
  fmt::print("{:<12} {:>7}  {}\n", "group", "experts", "domains");
  for (const auto& g : j["groups"])
    fmt::print("{:<12} {:>7}  {}\n", g["name"].get<std::string>(), g["experts"].get<int>(),
               fmt::join(g["domains"].get<std::vector<std::string>>(), ", "));
  if (j["tables"].empty()) return;
  fmt::print("{:<24} {:>6} {:>6} {:>9}\n", "routing table", "min", "max", "imbalance");
  for (const auto& t : j["tables"])
    fmt::print("{:<24} {:>6} {:>6} {:>9.3f}\n", t["name"].get<std::string>(),
               t["min"].get<int64_t>(), t["max"].get<int64_t>(), t["imbalance"].get<double>());
}

// --tensors: one line per weight and optimizer tensor, assembled whole whatever the layout
// (whole or sharded): "weights|optimizer NAME DTYPE [SHAPE] XXH3", by name. Two checkpoints
// hold the same tensors bit for bit exactly when these lines are the same (the files' bytes
// also hold the config and the layout, which may differ).
void print_tensors(const std::string& path) {
  const CheckpointInfo info = open_checkpoint(path);
  const auto print = [](const char* kind, const TensorMap& m) {
    for (const auto& [name, t] : m)
      fmt::print("{} {} {} [{}] {:016x}\n", kind, name, dtype_name(t.dtype()), fmt::join(t.shape(), ","),
                 XXH3_64bits(t.bytes(), size_t(t.nbytes())));
  };
  print("weights", read_model_tensors(info.dir));
  const bool sharded = is_sharded_checkpoint(info.dir);
  if (sharded ? !sharded_files(info.dir, true).empty()
              : std::filesystem::exists(info.dir + "/" + kOptimizerFile))
    print("optimizer", read_optimizer_tensors(info.dir));  // none in a surgery output
}

void run_inspect(const InspectArgs& a) {
  if (a.tensors) return print_tensors(a.ckpt);
  CheckpointInfo info;
  auto model = load_checkpoint_model(a.ckpt, &info);
  const nlohmann::json j = describe(*model, info);
  if (a.json)
    fmt::print("{}\n", j.dump(2));
  else
    print_text(j);
}

const RegisterCommand reg_inspect([](CLI::App& root) {
  auto a = std::make_shared<InspectArgs>();
  CLI::App* c = root.add_subcommand("inspect", "Describe a checkpoint: parameters, experts, routing");
  c->add_option("--ckpt", a->ckpt, fmt::format("Model: {}", kCkptForms))->required();
  c->add_flag("--json", a->json, "Print JSON instead of text");
  c->add_flag("--tensors", a->tensors,
              "Print every weight and optimizer tensor (name, dtype, shape, xxh3 of its bytes), "
              "assembled whole from either layout: equal lines, equal tensors bit for bit");
  c->callback([a] { run_inspect(*a); });
});

}  // namespace
}  // namespace sigma::cli
