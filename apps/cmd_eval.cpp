// sigma eval: held-out loss and perplexity per domain of a checkpoint, on prepared shards or on
// the checkpoint's own data source (the synthetic data's held-out stream, or data.eval_path);
// with --task, a task file's scores (docs/evaluation.md).
#include <fmt/format.h>
#include <xxhash.h>

#include <cmath>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>

#include "command.h"
#include "kernels/ops.h"
#include "core/json_depth.h"
#include "core/progress.h"
#include "data/tokenizer.h"
#include "eval/tasks.h"
#include "run/checkpoint.h"
#include "run/eval_domains.h"
#include "run/heldout.h"
#include "sigma_git_version.h"  // generated at build time: SIGMA_GIT_HASH

namespace sigma::cli {
namespace {

struct EvalArgs {
  std::string ckpt, data, domains, k = "1", log_samples, score_generations,
      precision = "fp32", backend = "cpu", kv_cache = "auto";
  int rows = 256, batch = 8;
  bool rows_given = false, batch_given = false, json = false;
  std::vector<std::string> tasks;  // --task, repeatable
  size_t limit = 0;
  int jobs = 0;  // --jobs; 0 = eval::default_sandbox_jobs
  double memory_mb = 1024;
  eval::TaskOptions opt;
};

struct HeldOut {
  std::unique_ptr<DataSource> source;
  std::string name;  // the folder, or "synthetic"
};

// --data, else the data the checkpoint was trained on: its held-out side, made by the
// checkpoint's own tokenizer (run/data_source.h, tokenizer_mismatch).
HeldOut open_held_out(const EvalArgs& a, const CheckpointInfo& info) {
  HeldOut h;
  const DataConfig& d = info.cfg.data;
  if (a.data.empty() && d.source == "synthetic") return {make_data_source(info.cfg), "synthetic"};
  SIGMA_CHECK(!a.data.empty() || !d.eval_path.empty(), "{} was trained on prepared shards ({}) and "
              "names no held-out directory (data.eval_path): pass --data HELDOUT_DIR (made by "
              "sigma prepare)", info.dir, d.path);
  h.name = a.data.empty() ? d.eval_path : a.data;
  h.source = make_eval_source(h.name, 0);
  const std::string other = tokenizer_mismatch(info.dir, *h.source, h.name);
  SIGMA_CHECK(other.empty(), "{}; evaluate on held-out text prepared with the checkpoint's "
              "tokenizer: sigma prepare --config HELDOUT.json --out DIR with \"tokenizer\" set to "
              "(a copy of) {} in HELDOUT.json, then --data DIR", other,
              checkpoint_tokenizer_path(info.dir));
  return h;
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
    // Without a tokenizer (token ids of the synthetic data) there are no bytes: null.
    const auto bpb = d.bits_per_byte();
    doms += fmt::format(", \"nats\": {}, \"bytes\": {}, \"bits_per_byte\": {}", json_number(d.nats),
                        d.bytes ? std::to_string(*d.bytes) : "null", bpb ? json_number(*bpb) : "null");
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
  fmt::print("{:<12} {:>10} {:>12} {:>10} {:>10}{}\n", "domain", "loss", "ppl", "tokens",
             "bits/byte", optimum ? fmt::format(" {:>10} {:>10}", "optimum", "gap") : "");
  for (const DomainLoss& d : result) {
    std::string extra;
    if (d.optimum) extra = fmt::format(" {:>10.4f} {:>10.4f}", *d.optimum, d.loss - *d.optimum);
    else if (optimum) extra = fmt::format(" {:>10} {:>10}", "-", "-");
    const auto bpb = d.bits_per_byte();
    fmt::print("{:<12} {:>10.4f} {:>12.3f} {:>10} {:>10}{}\n", d.name, d.loss, std::exp(d.loss),
               d.tokens, bpb ? fmt::format("{:.4f}", *bpb) : "-", extra);
  }
}

// The domain registry (prefix controls, line tags, format) to format task text as the model
// saw it in training: the checkpoint's own copy (written with it since issue 28); for an older
// checkpoint, --data's or the training shards' manifest.json, with a warning, since that
// folder may have changed or gone; else plain text, with a warning.
std::optional<DomainRegistry> data_registry(const EvalArgs& a, const CheckpointInfo& info) {
  if (auto own = checkpoint_data_domains(info.dir))
    return DomainRegistry::from_json(*own, info.dir + "/" + kDataDomainsFile, DomainForm::Data);
  std::string dir = a.data;
  if (dir.empty() && info.cfg.data.source == "shards") dir = info.cfg.data.path;
  const std::string path = dir + "/manifest.json";
  if (dir.empty() || !std::filesystem::exists(path)) {
    fmt::print(stderr, "sigma eval: warning: {} carries no data registry ({}) and {}; task text "
               "is formatted as plain text, without the domains' prefixes and line tags\n",
               info.dir, kDataDomainsFile, dir.empty() ? "no --data was given"
                                                        : "there is no " + path);
    return std::nullopt;
  }
  fmt::print(stderr, "sigma eval: warning: {} carries no data registry ({}); the prompt format "
             "is read from {}, which may differ from what the model was trained on\n", info.dir,
             kDataDomainsFile, path);
  std::ifstream in(path);
  const auto m = parse_json_or_discard(in);
  SIGMA_CHECK(!m.is_discarded() && m.contains("domains"), "{}: not a manifest made by sigma prepare", path);
  return DomainRegistry::from_json(m["domains"], path, DomainForm::Data);
}

// "0.75 ± 0.04" when the metric has a standard error.
std::string with_stderr(const nlohmann::json& group, const std::string& key, const nlohmann::json& v) {
  const auto se = group.find(key + "_stderr");
  if (se == group.end()) return v.dump();
  return fmt::format("{} ± {:.4f}", v.dump(), se->get<double>());
}

void print_task_table(const nlohmann::json& r) {
  fmt::print("task {} ({} items)\n", r["task"].get<std::string>(), r["items"].get<int64_t>());
  for (const char* kind : {"choice", "generate", "code", "rolling"}) {
    if (!r.contains(kind)) continue;
    const nlohmann::json& g = r[kind];
    for (const auto& [key, v] : g.items())
      if (v.is_number() && !key.ends_with("_stderr"))
        fmt::print("  {:<9} {:<12} {}\n", kind, key, with_stderr(g, key, v));
      else if (key == "bleu")
        for (const auto& [tok, b] : v.items())
          fmt::print("  {:<9} {:<12} {:.2f} ± {:.2f} (BP {:.3f}, {} / {} tokens) {}\n", kind,
                     "bleu." + tok, b["score"].get<double>(), b["stderr"].get<double>(),
                     b["bp"].get<double>(), b["sys_len"].dump(), b["ref_len"].dump(),
                     b["signature"].get<std::string>());
      else if (key == "chrf")
        fmt::print("  {:<9} {:<12} {:.2f} ± {:.2f} {}\n", kind, "chrf", v["score"].get<double>(),
                   v["stderr"].get<double>(), v["signature"].get<std::string>());
  }
  if (r.contains("code"))
    fmt::print("  sandbox: {}; failures {}\n", r["code"]["sandbox"].get<std::string>(), r["code"]["failures"].dump());
  if (r.contains("rolling"))
    for (const auto& [name, d] : r["rolling"]["domains"].items())
      fmt::print("  {:<9} {:<12} bits_per_byte {:.4f} ({} bytes, {} tokens, {} items)\n", "rolling",
                 name, d["bits_per_byte"].get<double>(), d["bytes"].dump(), d["tokens"].dump(),
                 d["items"].dump());
}

std::vector<int> parse_k(const std::string& text) {
  std::vector<int> ks;
  for (const std::string& k : split_names(text)) {
    size_t used = 0;
    int v = 0;
    try { v = std::stoi(k, &used); } catch (...) {}
    SIGMA_CHECK(used == k.size() && v >= 1, "--k: '{}' is not a positive integer", k);
    ks.push_back(v);
  }
  SIGMA_CHECK(!ks.empty(), "--k: '{}' names no k (give e.g. --k 1,10)", text);
  return ks;
}

// Writes the --log-samples file: one JSON object per item, in the task file's order.
void write_log(const std::string& path, const std::vector<nlohmann::json>& log) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  SIGMA_CHECK(out.good(), "--log-samples: cannot write {}", path);
  for (const nlohmann::json& j : log) out << j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
  out.flush();
  SIGMA_CHECK(out.good(), "--log-samples: writing {} failed", path);
}

// xxh3_64 of a file's bytes, 16 hex digits (which task file, exactly, was scored).
std::string file_xxh3(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  SIGMA_CHECK(in, "cannot open {}", path);
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  std::vector<char> buf(1 << 20);
  while (in.read(buf.data(), std::streamsize(buf.size())) || in.gcount() > 0)
    XXH3_64bits_update(st, buf.data(), size_t(in.gcount()));
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return fmt::format("{:016x}", h);
}

// What a task result needs to be reproduced and compared: the build, the date, the exact file
// and every setting that changes a score (docs/evaluation.md, "Results describe themselves").
void describe_run(nlohmann::json& r, const EvalArgs& a, const std::string& file, size_t items_in_file) {
  char date[32];
  const std::time_t now = std::time(nullptr);
  std::strftime(date, sizeof date, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const eval::TaskOptions& o = a.opt;
  r["sigma"] = {{"version", SIGMA_VERSION}, {"git", SIGMA_GIT_HASH}};
  r["date"] = date;
  r["task_xxh3_64"] = file_xxh3(file);
  r["settings"] = {{"num_fewshot", o.num_fewshot}, {"fewshot_seed", o.fewshot_seed},
                   {"temperature", o.temperature}, {"top_k", o.top_k}, {"top_p", o.top_p},
                   {"seed", o.seed}, {"max_new", o.max_new}, {"samples", o.samples}, {"k", o.k},
                   {"bootstrap", o.bootstrap}, {"precision", a.precision},
                   {"kv_cache", a.kv_cache}, {"jobs", o.jobs},
                   {"timeout_s", o.sandbox.seconds}, {"memory_mb", a.memory_mb},
                   {"limit", a.limit}, {"items_in_file", items_in_file}};
}

// The warning for prompts cut to fit the context (stderr), then the result on stdout.
void warn_cut(const nlohmann::json& r, const EvalArgs& a) {
  if (const int64_t cut = r.value("prompts_cut", int64_t(0)); cut > 0)
    fmt::print(stderr, "sigma eval: warning: {} of {} prompts were cut at their start to fit the "
               "model's context{} (the domain's prefix controls kept; \"prompts_cut\" per kind in "
               "--json; --log-samples shows each prompt as the model saw it)\n", cut,
               r["items"].get<int64_t>(), r.contains("context")
                   ? fmt::format(" of {} tokens, less --max-new {} for generated answers",
                                 r["context"].get<int>(), a.opt.max_new)
                   : "");
}

void print_result(nlohmann::json& r, const EvalArgs& a, const std::vector<nlohmann::json>& log) {
  if (!a.log_samples.empty()) write_log(a.log_samples, log);
  warn_cut(r, a);
  if (a.json) fmt::print("{}\n", r.dump());
  else print_task_table(r);
}

// --score-generations: the scores of a --log-samples file (or one written by another tool in
// its format) without a model; code samples run in the sandbox again.
void run_score_generations(EvalArgs a) {
  a.opt.k = parse_k(a.k);
  a.opt.sandbox.memory_bytes = uint64_t(a.memory_mb * (1 << 20));
  a.opt.jobs = a.jobs > 0 ? a.jobs : eval::default_sandbox_jobs(a.opt.sandbox);
  a.opt.progress = true;
  std::vector<eval::TaskItem> items;
  std::vector<eval::ItemOutput> outs;
  eval::read_sample_log(a.score_generations, items, outs);
  std::vector<nlohmann::json> log;
  const size_t in_file = items.size();
  if (a.limit > 0 && items.size() > a.limit) items.resize(a.limit), outs.resize(a.limit);
  nlohmann::json r = eval::score_items(items, outs, a.opt, a.log_samples.empty() ? nullptr : &log);
  r["task"] = a.score_generations;
  describe_run(r, a, a.score_generations, in_file);
  print_result(r, a, log);
}

// --log-samples with several tasks: a folder of one file per task, "N-STEM.jsonl" (N: the
// task's place on the command line, from 1).
std::string log_path(const EvalArgs& a, size_t t) {
  if (a.log_samples.empty() || a.tasks.size() == 1) return a.log_samples;
  return (std::filesystem::path(a.log_samples) /
          fmt::format("{}-{}.jsonl", t + 1, std::filesystem::path(a.tasks[t]).stem().string())).string();
}

// Every --task on one loaded model, one after the other. With one task the result is that
// task's object; with several, {"tasks": [each task's object, in order], ...}, each as
// self-describing as a single task's (its file's hash, its settings, the build and date).
void run_task(EvalArgs a) {
  CheckpointInfo info;
  auto model = load_checkpoint_model(a.ckpt, &info);
  model->use_weights(weight_format_from_name(a.precision));
  a.kv_cache = kv_cache_type(a.kv_cache, a.precision);
  model->use_kv_cache(kv_cache_dtype(a.kv_cache));
  const std::string tok_path = checkpoint_tokenizer_path(info.dir);
  SIGMA_CHECK(!tok_path.empty(), "{} has no tokenizer (it was trained on token ids, e.g. the "
              "synthetic data); tasks are text, so evaluate a model trained on prepared shards", info.dir);
  const data::Tokenizer tok = data::Tokenizer::load(tok_path);
  // Every file is read and checked before any is scored: a typo in the last should not waste
  // the first's run.
  std::vector<std::vector<eval::TaskItem>> files;
  for (const std::string& task : a.tasks)
    files.push_back(eval::read_task_file(task, model->config().domains.names()));
  a.opt.k = parse_k(a.k);
  const auto registry = data_registry(a, info);
  a.opt.sandbox.memory_bytes = uint64_t(a.memory_mb * (1 << 20));
  a.opt.jobs = a.jobs > 0 ? a.jobs : eval::default_sandbox_jobs(a.opt.sandbox);
  a.opt.progress = true;
  a.opt.limit = a.limit;
  if (a.tasks.size() > 1 && !a.log_samples.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(a.log_samples, ec);
    SIGMA_CHECK(std::filesystem::is_directory(a.log_samples), "--log-samples {}: with {} tasks this "
                "names a folder (one N-STEM.jsonl per task) and it cannot be made: {}",
                a.log_samples, a.tasks.size(), ec ? ec.message() : "a file of that name exists");
  }
  nlohmann::json all = nlohmann::json::array();
  for (size_t t = 0; t < a.tasks.size(); ++t) {
    if (a.tasks.size() > 1) fmt::print(stderr, "sigma eval: task {} of {}: {}\n", t + 1, a.tasks.size(), a.tasks[t]);
    std::vector<nlohmann::json> log;
    const std::string path = log_path(a, t);
    nlohmann::json r = eval::run_tasks({*model, tok, registry ? &*registry : nullptr}, files[t], a.opt,
                                       path.empty() ? nullptr : &log);
    r["task"] = a.tasks[t];
    describe_run(r, a, a.tasks[t], files[t].size());
    r["checkpoint"] = info.dir;
    r["context"] = model->config().context;
    if (!path.empty()) write_log(path, log);
    if (!path.empty() && a.tasks.size() > 1) r["log_samples"] = path;  // which file of the folder
    warn_cut(r, a);
    if (a.tasks.size() == 1) {
      if (a.json) fmt::print("{}\n", r.dump());
      else print_task_table(r);
      return;
    }
    if (!a.json) print_task_table(r);
    all.push_back(std::move(r));
  }
  if (a.json) {
    nlohmann::json out = {{"tasks", all}, {"checkpoint", info.dir}};
    out["sigma"] = all[0]["sigma"];
    out["date"] = all[0]["date"];
    fmt::print("{}\n", out.dump());
  }
}

void run_eval(const EvalArgs& a) {
  // Ctrl-C or a scheduler's SIGTERM: a message, the signal's own exit status, and no sandboxed
  // sample or sandbox folder left behind.
  eval::exit_cleanly_on_interrupt();
  if (!a.score_generations.empty()) return run_score_generations(a);
  ops::use_backend(a.backend);
  SIGMA_CHECK(!a.ckpt.empty(), "--ckpt is required (except with --score-generations)");
  if (!a.tasks.empty()) return run_task(a);
  CheckpointInfo info;
  auto model = load_checkpoint_model(a.ckpt, &info);
  model->use_weights(weight_format_from_name(a.precision));
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
  // Bits per byte: the bytes of the scored tokens' text, by the tokenizer behind the ids (the
  // checkpoint's, which the data must match; else the data's own). None for token-id data.
  std::string tok_path = checkpoint_tokenizer_path(info.dir);
  if (tok_path.empty()) tok_path = held.source->tokenizer_path();
  const std::vector<int32_t> token_bytes =
      tok_path.empty() ? std::vector<int32_t>{} : token_byte_counts(tok_path);
  auto source = keep_domains(std::move(held.source), chosen.keep);
  // Without --data the defaults are the training run's, so the losses are those its end printed.
  const TrainConfig& t = info.cfg.train;
  const int rows = a.rows_given || !a.data.empty() ? a.rows : t.eval_rows;
  const int batch = a.batch_given || !a.data.empty() ? a.batch : t.batch;
  // Progress after the first 10 s (2 s on a terminal): a large --rows on a big model is minutes.
  // The total is --rows per domain; a domain with fewer complete windows ends the count short.
  Progress shown("sigma eval: held-out", uint64_t(rows) * chosen.keep.size(), "rows");
  const auto result = evaluate(*model, *source, batch, model->config().context, rows,
                               [&](int n) { shown.add(uint64_t(n)); }, token_bytes);
  shown.finish();
  for (const DomainLoss& d : result)
    SIGMA_CHECK(d.tokens > 0, "{}: domain '{}' has no complete window of {} tokens", held.name,
                d.name, model->config().context + 1);
  if (a.json)
    print_json(info, held.name, result, chosen);
  else
    print_table(result);
}

const RegisterCommand reg_eval([](CLI::App& root) {
  auto a = std::make_shared<EvalArgs>();
  CLI::App* c = root.add_subcommand("eval", "Held-out loss and perplexity per domain");
  c->add_option("--ckpt", a->ckpt, fmt::format("Model: {}; required except with --score-generations", kCkptForms));
  c->add_option("--precision", a->precision,
                 "Weights the forward passes read: fp32, bf16 or int8 (per-channel scales), "
                 "converted at load as `sigma serve --precision` does")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}));
  c->add_option("--data", a->data, "Held-out directory made by sigma prepare (default: the "
                "checkpoint's own data: the synthetic held-out stream, or data.eval_path)");
  c->add_option("--domains", a->domains, "Evaluate only these domains, comma-separated "
                "(default: every held-out domain the model knows)");
  c->add_option("--rows", a->rows, "Windows per domain (default 256 with --data, else the run's "
                "train.eval_rows)")->check(CLI::Range(1, 1 << 24));
  c->add_option("--batch", a->batch, "Rows per forward pass (default 8 with --data, else the "
                "run's train.batch)")->check(CLI::Range(1, 4096));
  c->add_option("--task", a->tasks, "Score a task file instead (JSONL: multiple choice, generation "
                "with BLEU / exact match, code with pass@k, rolling log-likelihood with bits per "
                "byte; docs/evaluation.md); repeat for several tasks on one loaded model")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll)->expected(1);
  c->add_option("--jobs", a->jobs, "Code tasks: samples run at once, each in its own sandbox "
                "(default: the cores, at most as many as free memory holds at --memory-mb each)")
      ->check(CLI::Range(1, 256));
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
  c->add_option("--memory-mb", a->memory_mb, "Code tasks: memory limit per sample: each process's address space, and all its processes together where a cgroup can be made (default 1024)")
      ->check(CLI::Range(64.0, 1e6));
  add_backend_option(*c, a->backend);
  add_kv_cache_option(*c, a->kv_cache);
  c->add_option("--log-samples", a->log_samples, "With --task or --score-generations: write "
                "one JSON line per item (prompt, generations, per-choice log-likelihoods, metric "
                "values, sandbox outcomes) to this file");
  c->add_option("--score-generations", a->score_generations, "Score a --log-samples file "
                "(saved generations and log-likelihoods) without a model; code samples run again");
  c->add_option("--score-batch", a->opt.score_batch, "Multiple choice: items per forward pass, "
                "each context computed once for all its choices (default 32); the "
                "log-likelihoods have the same bits at any value (docs/evaluation.md)")
      ->check(CLI::Range(1, 4096));
  c->add_option("--num-fewshot", a->opt.num_fewshot, "Solved examples (other items of the same "
                "kind and domain, never the item itself) before each item's context")
      ->check(CLI::Range(0, 1000));
  c->add_option("--fewshot-seed", a->opt.fewshot_seed, "Seed of the few-shot sampler (default 1234)");
  c->add_option("--limit", a->limit, "Tasks: score only the file's first N items (stated in "
                "--json; few-shot examples still come from the whole file)")->check(CLI::Range(1, 1 << 30));
  c->add_option("--bootstrap", a->opt.bootstrap, "Resamples for the standard errors (default "
                "1000, 0 = none)")->check(CLI::Range(0, 1000000));
  c->add_flag("--json", a->json, "Print {\"domains\": {NAME: {\"loss\", \"ppl\", \"tokens\", "
              "\"nats\", \"bytes\", \"bits_per_byte\"}}, "
              "\"skipped\": {NAME: WHY}}; with --task {\"choice\", \"generate\", \"code\"} "
              "scores (docs/evaluation.md)");
  c->callback([a, c] {
    if (!a->score_generations.empty())  // scores saved completions: no model, no windows
      refuse_given(*c, {"--backend", "--samples", "--temperature", "--top-k", "--top-p", "--seed", "--max-new",
                        "--domains", "--rows", "--batch", "--kv-cache"},
                   "--score-generations scores saved completions and runs no model");
    else if (a->tasks.empty())
      refuse_given(*c, {"--samples", "--k", "--temperature", "--top-k", "--top-p", "--seed",
                        "--max-new", "--timeout", "--memory-mb", "--limit", "--jobs", "--kv-cache"},
                   "without --task, sigma eval measures held-out loss and generates nothing");
    else
      refuse_given(*c, {"--domains", "--rows", "--batch"},
                   "they choose held-out loss windows, and --task scores a task file");
    if (!a->tasks.empty() && a->opt.temperature <= 0)
      refuse_given(*c, {"--top-k", "--top-p", "--seed"}, "--temperature 0 (the default) decodes "
                   "greedily; give --temperature > 0 to sample");
    a->rows_given = c->count("--rows") > 0;
    a->batch_given = c->count("--batch") > 0;
    run_eval(*a);
  });
});

}  // namespace
}  // namespace sigma::cli
