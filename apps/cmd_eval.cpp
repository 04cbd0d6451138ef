// sigma eval: held-out loss and perplexity per domain of a checkpoint, on prepared shards or on
// the checkpoint's own data source (the synthetic data's held-out stream, or data.eval_path);
// with --task, a task file's scores (docs/evaluation.md).
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>

#include "command.h"
#include "core/json_depth.h"
#include "data/tokenizer.h"
#include "eval/tasks.h"
#include "run/checkpoint.h"
#include "run/eval_domains.h"
#include "run/heldout.h"

namespace sigma::cli {
namespace {

struct EvalArgs {
  std::string ckpt, data, domains, task, k = "1";
  int rows = 256, batch = 8;
  bool rows_given = false, batch_given = false, json = false;
  double memory_mb = 1024;
  eval::TaskOptions opt;
};

struct HeldOut {
  std::unique_ptr<DataSource> source;
  std::string name;  // the folder, or "synthetic"
};

// --data, else the data the checkpoint was trained on: its held-out side.
HeldOut open_held_out(const EvalArgs& a, const CheckpointInfo& info) {
  const std::string tok = checkpoint_tokenizer_path(info.dir);
  const uint64_t hash = tok.empty() ? 0 : data::Tokenizer::load(tok).hash();
  if (!a.data.empty()) return {make_eval_source(a.data, hash), a.data};
  const DataConfig& d = info.cfg.data;
  if (d.source == "synthetic") return {make_data_source(info.cfg), "synthetic"};
  SIGMA_CHECK(!d.eval_path.empty(), "{} was trained on prepared shards ({}) and names no "
              "held-out directory (data.eval_path): pass --data HELDOUT_DIR (made by sigma "
              "prepare)", info.dir, d.path);
  return {make_eval_source(d.eval_path, hash), d.eval_path};
}

std::vector<std::string> split_names(const std::string& s) {
  std::vector<std::string> out;
  for (size_t b = 0; b <= s.size();) {
    const size_t e = std::min(s.find(',', b), s.size());
    if (e > b) out.push_back(s.substr(b, e - b));
    b = e + 1;
  }
  return out;
}

// A JSON number with 17 significant digits, so it round-trips exactly; NaN and Inf (an
// overflowing perplexity) have no JSON spelling and print as null.
std::string json_number(double x) {
  return std::isfinite(x) ? fmt::format("{:.17g}", x) : "null";
}

void print_json(const CheckpointInfo& info, const std::string& data,
                const std::vector<DomainLoss>& result, const EvalDomains& chosen) {
  std::string doms, skipped;
  for (const DomainLoss& d : result) {
    doms += fmt::format("{}{}: {{\"loss\": {}, \"ppl\": {}, \"tokens\": {}", doms.empty() ? "" : ", ",
                        nlohmann::json(d.name).dump(), json_number(d.loss),
                        json_number(std::exp(d.loss)), d.tokens);
    if (d.optimum) doms += fmt::format(", \"optimum\": {}", json_number(*d.optimum));
    doms += "}";
  }
  for (const auto& [name, why] : chosen.skipped)
    skipped += fmt::format("{}{}: {}", skipped.empty() ? "" : ", ", nlohmann::json(name).dump(),
                           nlohmann::json(why).dump());
  fmt::print("{{\"checkpoint\": {}, \"data\": {}, \"domains\": {{{}}}, \"skipped\": {{{}}}}}\n",
             nlohmann::json(info.dir).dump(), nlohmann::json(data).dump(), doms, skipped);
}

void print_table(const std::vector<DomainLoss>& result) {
  const bool optimum = std::any_of(result.begin(), result.end(),
                                   [](const DomainLoss& d) { return d.optimum.has_value(); });
  fmt::print("{:<12} {:>10} {:>12} {:>10}{}\n", "domain", "loss", "ppl", "tokens",
             optimum ? fmt::format(" {:>10} {:>10}", "optimum", "gap") : "");
  for (const DomainLoss& d : result) {
    std::string extra;
    if (d.optimum) extra = fmt::format(" {:>10.4f} {:>10.4f}", *d.optimum, d.loss - *d.optimum);
    else if (optimum) extra = fmt::format(" {:>10} {:>10}", "-", "-");
    fmt::print("{:<12} {:>10.4f} {:>12.3f} {:>10}{}\n", d.name, d.loss, std::exp(d.loss), d.tokens,
               extra);
  }
}

// The prepared data's domain registry (prefix controls, format) to format task text as the
// model saw it in training: --data, else the run's training shards; null when neither exists.
std::optional<DomainRegistry> data_registry(const EvalArgs& a, const CheckpointInfo& info) {
  std::string dir = a.data;
  if (dir.empty() && info.cfg.data.source == "shards") dir = info.cfg.data.path;
  const std::string path = dir + "/manifest.json";
  if (dir.empty() || !std::filesystem::exists(path)) return std::nullopt;
  std::ifstream in(path);
  const auto m = parse_json_or_discard(in);
  SIGMA_CHECK(!m.is_discarded() && m.contains("domains"), "{}: not a manifest made by sigma prepare", path);
  return DomainRegistry::from_json(m["domains"], path, DomainForm::Data);
}

void print_task_table(const nlohmann::json& r) {
  fmt::print("task {} ({} items)\n", r["task"].get<std::string>(), r["items"].get<int64_t>());
  for (const char* kind : {"choice", "generate", "code"}) {
    if (!r.contains(kind)) continue;
    for (const auto& [key, v] : r[kind].items())
      if (v.is_number()) fmt::print("  {:<9} {:<12} {}\n", kind, key, v.dump());
      else if (key == "bleu")
        for (const auto& [tok, b] : v.items())
          fmt::print("  {:<9} {:<12} {:.2f} (BP {:.3f}, {} / {} tokens)\n", kind, "bleu." + tok,
                     b["score"].get<double>(), b["bp"].get<double>(), b["sys_len"].dump(), b["ref_len"].dump());
  }
  if (r.contains("code"))
    fmt::print("  sandbox: {}; failures {}\n", r["code"]["sandbox"].get<std::string>(), r["code"]["failures"].dump());
}

void run_task(EvalArgs a) {
  CheckpointInfo info;
  auto model = load_checkpoint_model(a.ckpt, &info);
  const std::string tok_path = checkpoint_tokenizer_path(info.dir);
  SIGMA_CHECK(!tok_path.empty(), "{} has no tokenizer (it was trained on token ids, e.g. the "
              "synthetic data); tasks are text, so evaluate a model trained on prepared shards", info.dir);
  const data::Tokenizer tok = data::Tokenizer::load(tok_path);
  const auto items = eval::read_task_file(a.task, model->config().domains.names());
  const auto registry = data_registry(a, info);
  a.opt.k.clear();
  for (const std::string& k : split_names(a.k)) {
    size_t used = 0;
    int v = 0;
    try { v = std::stoi(k, &used); } catch (...) {}
    SIGMA_CHECK(used == k.size() && v >= 1, "--k: '{}' is not a positive integer", k);
    a.opt.k.push_back(v);
  }
  a.opt.sandbox.memory_bytes = uint64_t(a.memory_mb * (1 << 20));
  nlohmann::json r = eval::run_tasks({*model, tok, registry ? &*registry : nullptr}, items, a.opt);
  r["task"] = a.task;
  r["checkpoint"] = info.dir;
  if (a.json) fmt::print("{}\n", r.dump());
  else print_task_table(r);
}

void run_eval(const EvalArgs& a) {
  if (!a.task.empty()) return run_task(a);
  CheckpointInfo info;
  auto model = load_checkpoint_model(a.ckpt, &info);
  HeldOut held = open_held_out(a, info);
  SIGMA_CHECK(held.source->vocab() <= model->config().vocab,
              "{}: the data uses a vocabulary of {} but the model has {}", held.name,
              held.source->vocab(), model->config().vocab);
  const EvalDomains chosen = choose_eval_domains(held.source->domains(), model->config(),
                                                 split_names(a.domains), held.name);
  if (!chosen.skipped.empty() && a.domains.empty()) {
    std::vector<std::string> parts;
    for (const auto& [name, why] : chosen.skipped) parts.push_back(fmt::format("{} ({})", name, why));
    fmt::print(stderr, "sigma eval: skipped {}; evaluating {} (choose with --domains)\n",
               fmt::join(parts, ", "), fmt::join(chosen.keep, ", "));
  }
  auto source = keep_domains(std::move(held.source), chosen.keep);
  // Without --data the defaults are the training run's, so the losses are those its end printed.
  const TrainConfig& t = info.cfg.train;
  const int rows = a.rows_given || !a.data.empty() ? a.rows : t.eval_rows;
  const int batch = a.batch_given || !a.data.empty() ? a.batch : t.batch;
  const auto result = evaluate(*model, *source, batch, model->config().context, rows);
  for (const DomainLoss& d : result)
    SIGMA_CHECK(d.tokens > 0, "{}: domain '{}' has no complete window of {} tokens", held.name,
                d.name, model->config().context + 1);
  if (a.json)
    print_json(info, held.name, result, chosen);
  else
    print_table(result);
}

const RegisterCommand reg([](CLI::App& root) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* c = root.add_subcommand("eval", "Held-out loss and perplexity per domain");
  c->add_option("--ckpt", a->ckpt, "Checkpoint directory (or a checkpoints/ root)")->required();
  c->add_option("--data", a->data, "Held-out directory made by sigma prepare (default: the "
                "checkpoint's own data: the synthetic held-out stream, or data.eval_path)");
  c->add_option("--domains", a->domains, "Evaluate only these domains, comma-separated "
                "(default: every held-out domain the model knows)");
  c->add_option("--rows", a->rows, "Windows per domain (default 256 with --data, else the run's "
                "train.eval_rows)")->check(CLI::Range(1, 1 << 24));
  c->add_option("--batch", a->batch, "Rows per forward pass (default 8 with --data, else the "
                "run's train.batch)")->check(CLI::Range(1, 4096));
  c->add_option("--task", a->task, "Score a task file instead (JSONL: multiple choice, generation "
                "with BLEU / exact match, code with pass@k; docs/evaluation.md)");
  c->add_option("--samples", a->opt.samples, "Code tasks: completions per problem (the n of "
                "pass@k)")->check(CLI::Range(1, 1000));
  c->add_option("--k", a->k, "Code tasks: the k of pass@k, comma-separated (default 1)");
  c->add_option("--temperature", a->opt.temperature, "Generation: 0 = greedy (default); use > 0 "
                "with --samples > 1")->check(CLI::Range(0.0, 100.0));
  c->add_option("--top-k", a->opt.top_k, "Generation: keep the k most likely tokens (0 = off)")
      ->check(CLI::NonNegativeNumber);
  c->add_option("--top-p", a->opt.top_p, "Generation: nucleus mass (1 = off)")->check(CLI::Range(0.0, 1.0));
  c->add_option("--seed", a->opt.seed, "Generation: sampling seed");
  c->add_option("--max-new", a->opt.max_new, "Generation: tokens per answer at most (default 64)")
      ->check(CLI::Range(1, 1 << 20));
  c->add_option("--timeout", a->opt.sandbox.seconds, "Code tasks: seconds per sample (default 10)")
      ->check(CLI::Range(0.1, 3600.0));
  c->add_option("--memory-mb", a->memory_mb, "Code tasks: address-space limit per sample (default 1024)")
      ->check(CLI::Range(64.0, 1e6));
  c->add_flag("--json", a->json, "Print {\"domains\": {NAME: {\"loss\", \"ppl\", \"tokens\"}}, "
              "\"skipped\": {NAME: WHY}}; with --task {\"choice\", \"generate\", \"code\"} "
              "scores (docs/evaluation.md)");
  c->callback([a, c] {
    a->rows_given = c->count("--rows") > 0;
    a->batch_given = c->count("--batch") > 0;
    run_eval(*a);
  });
});

}  // namespace
}  // namespace sigma::cli
