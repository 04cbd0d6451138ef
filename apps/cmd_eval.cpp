// sigma eval: held-out loss and perplexity per domain of a checkpoint on prepared shards.
#include <fmt/format.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "command.h"
#include "data/tokenizer.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace sigma::cli {
namespace {

struct EvalArgs {
  std::string ckpt, data;
  int rows = 256, batch = 8;
  bool json = false;
};

void run_eval(const EvalArgs& a) {
  CheckpointInfo info;
  auto model = load_checkpoint_model(a.ckpt, &info);
  const std::string tok = checkpoint_tokenizer_path(info.dir);
  const uint64_t hash = tok.empty() ? 0 : data::Tokenizer::load(tok).hash();
  auto source = make_eval_source(a.data, hash);
  SIGMA_CHECK(source->vocab() <= model->config().vocab,
              "{}: shards use a vocabulary of {} but the model has {}", a.data, source->vocab(),
              model->config().vocab);
  const auto result = evaluate(*model, *source, a.batch, model->config().context, a.rows);
  const auto names = source->domains();
  nlohmann::json out = {{"checkpoint", info.dir}, {"data", a.data}, {"domains", nlohmann::json::object()}};
  for (const DomainLoss& d : result) {
    SIGMA_CHECK(d.tokens > 0, "{}: domain '{}' has no complete window of {} tokens", a.data,
                d.name, model->config().context + 1);
    out["domains"][d.name] = {{"loss", d.loss}, {"ppl", std::exp(d.loss)}, {"tokens", d.tokens}};
  }
  if (a.json) {  // losses with 17 significant digits, so they round-trip exactly
    std::string doms;
    for (size_t d = 0; d < names.size(); ++d) {
      const auto& r = out["domains"][names[d]];
      doms += fmt::format("{}{}: {{\"loss\": {:.17g}, \"ppl\": {:.17g}, \"tokens\": {}}}",
                          d ? ", " : "", nlohmann::json(names[d]).dump(), r["loss"].get<double>(),
                          r["ppl"].get<double>(), r["tokens"].get<int64_t>());
    }
    fmt::print("{{\"checkpoint\": {}, \"data\": {}, \"domains\": {{{}}}}}\n",
               nlohmann::json(info.dir).dump(), nlohmann::json(a.data).dump(), doms);
    return;
  }
  fmt::print("{:<12} {:>10} {:>12} {:>10}\n", "domain", "loss", "ppl", "tokens");
  for (size_t d = 0; d < names.size(); ++d) {
    const auto& r = out["domains"][names[d]];
    fmt::print("{:<12} {:>10.4f} {:>12.3f} {:>10}\n", names[d], r["loss"].get<double>(),
               r["ppl"].get<double>(), r["tokens"].get<int64_t>());
  }
}

const RegisterCommand reg([](CLI::App& root) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* c = root.add_subcommand("eval", "Held-out loss and perplexity per domain");
  c->add_option("--ckpt", a->ckpt, "Checkpoint directory (or a checkpoints/ root)")->required();
  c->add_option("--data", a->data, "Held-out directory made by sigma prepare")->required();
  c->add_option("--rows", a->rows, "Windows per domain (spread evenly through each shard)")
      ->check(CLI::Range(1, 1 << 24));
  c->add_option("--batch", a->batch, "Rows per forward pass")->check(CLI::Range(1, 4096));
  c->add_flag("--json", a->json, "Print {\"domains\": {NAME: {\"loss\", \"ppl\", \"tokens\"}}}");
  c->callback([a] { run_eval(*a); });
});

}  // namespace
}  // namespace sigma::cli
