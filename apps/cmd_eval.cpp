// sigma eval: held-out loss and perplexity per domain of a checkpoint, on prepared shards or on
// the checkpoint's own data source (the synthetic data's held-out stream, or data.eval_path).
#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "command.h"
#include "data/tokenizer.h"
#include "train/checkpoint.h"
#include "train/eval_domains.h"
#include "train/trainer.h"

namespace sigma::cli {
namespace {

struct EvalArgs {
  std::string ckpt, data, domains;
  int rows = 256, batch = 8;
  bool rows_given = false, batch_given = false, json = false;
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

void run_eval(const EvalArgs& a) {
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
  c->add_flag("--json", a->json, "Print {\"domains\": {NAME: {\"loss\", \"ppl\", \"tokens\"}}, "
              "\"skipped\": {NAME: WHY}}");
  c->callback([a, c] {
    a->rows_given = c->count("--rows") > 0;
    a->batch_given = c->count("--batch") > 0;
    run_eval(*a);
  });
});

}  // namespace
}  // namespace sigma::cli
