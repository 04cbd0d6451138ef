#include "train/trainer.h"

#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <optional>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include "model/routing.h"
#include "kernels/ops.h"
#include "optim/adamw.h"
#include "train/checkpoint.h"
#include "train/freeze.h"

namespace sigma {

namespace {

using Clock = std::chrono::steady_clock;

std::string fmt_duration(double s) {
  const int64_t t = int64_t(s + 0.5);
  return t >= 3600 ? fmt::format("{}h{:02d}m", t / 3600, t / 60 % 60)
                   : fmt::format("{}m{:02d}s", t / 60, t % 60);
}

// Per-domain sums of masked token losses.
struct DomainSums {
  std::vector<double> loss;
  std::vector<int64_t> count;
  explicit DomainSums(size_t n) : loss(n, 0.0), count(n, 0) {}
  void add(const Batch& b, const std::vector<float>& token_loss) {
    for (int r = 0; r < b.B; ++r)
      for (int t = 0; t < b.T; ++t) {
        const size_t i = size_t(r) * b.T + t;
        if (b.mask[i] == 0.0f) continue;
        loss[b.domain[r]] += token_loss[i];
        count[b.domain[r]] += 1;
      }
  }
  double total_mean() const {
    double l = 0;
    int64_t c = 0;
    for (size_t i = 0; i < loss.size(); ++i) l += loss[i], c += count[i];
    return c ? l / double(c) : 0.0;
  }
};

void check_same_model(Config& a, Config& b) {
  const auto ja = a.to_json()["model"], jb = b.to_json()["model"];
  SIGMA_CHECK(ja == jb, "the model config differs from the checkpoint's (checkpoint: {}, now: {})",
              jb.dump(), ja.dump());
}

}  // namespace

nlohmann::json expert_load_json(const std::vector<BlockLoad>& load, const ModelConfig& cfg) {
  nlohmann::json j = nlohmann::json::object();
  for (const BlockLoad& b : load) {
    nlohmann::json groups = nlohmann::json::object();
    for (size_t g = 0; g < b.tokens.size(); ++g) groups[cfg.groups[g].name] = b.tokens[g];
    j[std::to_string(b.block)] = groups;
  }
  return j;
}

nlohmann::json load_imbalance_json(const std::vector<BlockLoad>& load) {
  nlohmann::json j = nlohmann::json::object();
  for (const BlockLoad& b : load) j[std::to_string(b.block)] = b.imbalance();
  return j;
}

std::vector<DomainLoss> evaluate(Model& model, const DataSource& data, int B, int T,
                                 int rows_per_domain, ExpertOffload* experts) {
  // The source's domains are scored as the model's domains of the same names.
  const auto names = data.domains();
  std::vector<int32_t> to_model;
  for (const auto& n : names) to_model.push_back(model.config().domain_index(n));
  DomainSums sums(names.size());
  std::vector<float> token_loss;
  Batch mb;
  data.eval_batches(B, T, rows_per_domain, [&](const Batch& b) {
    mb = b;
    for (auto& d : mb.domain) d = to_model[size_t(d)];
    if (experts) experts->begin_step({&mb, 1});  // bind the experts this batch routes to
    token_loss.resize(size_t(b.B) * b.T);
    model.forward(mb, token_loss.data());
    sums.add(b, token_loss);
  });
  std::vector<DomainLoss> out;
  for (size_t d = 0; d < names.size(); ++d)
    out.push_back({names[d], sums.count[d] ? sums.loss[d] / double(sums.count[d]) : 0.0,
                   sums.count[d], data.optimum(int(d), T)});
  return out;
}

TrainSummary train(Config cfg, const RunOptions& run) {
  ops::use_backend(cfg.train.backend);
  if (cfg.train.threads > 0) omp_set_num_threads(cfg.train.threads);
  std::unique_ptr<DataSource> data = make_data_source(cfg);
  bind_model_to_data(cfg.model, *data);
  cfg.model.validate();

  // Frequency-balanced routing tables come from the training data's token counts per group
  // (a resumed run takes its tables from the checkpoint instead).
  TokenCounts group_counts;
  const bool need_counts =
      cfg.model.rre_layers > 0 && cfg.model.routing == "frequency" && run.resume.empty();
  if (need_counts) {
    const auto per_domain = data->domain_token_counts(cfg.model.vocab);
    SIGMA_CHECK(!per_domain.empty(), "model.routing = 'frequency' needs token counts, which "
                "data.source = '{}' does not provide; use model.routing = random", cfg.data.source);
    for (const auto& [name, counts] : per_domain) {
      auto& g = group_counts[cfg.model.domains[cfg.model.domain_index(name)].group];
      g.resize(counts.size(), 0);
      for (size_t i = 0; i < counts.size(); ++i) g[i] += counts[i];
    }
  }
  const ExpertMode mode = resolve_expert_mode(cfg.train.experts, cfg.model);
  Model model(cfg.model, cfg.train.seed, need_counts ? &group_counts : nullptr,
              mode != ExpertMode::InModel);
  AdamW opt(cfg.optim, model.params());
  TrainerState state;
  std::optional<CheckpointInfo> ck;
  if (!run.resume.empty()) {  // checked before the expert store is opened
    ck = open_checkpoint(run.resume);
    check_same_model(cfg, ck->cfg);
  }
  // Checked before the store is created: a bad selector leaves no store file behind.
  const FreezePlan freeze = plan_freeze(cfg.train.freeze, cfg.model, model.params(),
                                       model.external_experts(), data->domains());
  // ECSS: the experts and their Adam state live in the store, not in `model` and `opt`.
  std::unique_ptr<ExpertOffload> experts;
  if (mode != ExpertMode::InModel)
    experts = std::make_unique<ExpertOffload>(model, mode, cfg.optim, cfg.train.expert_store,
                                              ck.has_value());
  if (ck) {
    load_model(model, ck->dir);
    load_optimizer(opt, model.params(), ck->dir);
    if (experts) experts->load(ck->dir);
    state = ck->state;
    if (!state.data_cursor.is_null()) data->restore(state.data_cursor);
  }
  if (experts) experts->set_frozen(freeze.frozen_experts);
  const int B = cfg.train.batch, T = cfg.model.context;
  const int64_t last = run.stop_at >= 0 ? std::min(run.stop_at, cfg.train.steps) : cfg.train.steps;
  // Training losses are kept per model domain; the data may hold a subset of them (an extract
  // or a newly added domain trained alone).
  std::vector<std::string> names;
  for (const auto& d : cfg.model.domains) names.push_back(d.name);
  std::vector<int32_t> data_to_model;
  for (const auto& n : data->domains()) data_to_model.push_back(cfg.model.domain_index(n));

  std::ofstream metrics;
  std::string ckpt_root;
  if (!run.out_dir.empty()) {
    std::filesystem::create_directories(run.out_dir);
    metrics.open(run.out_dir + "/metrics.jsonl", std::ios::app);
    SIGMA_CHECK(metrics.good(), "cannot write {}/metrics.jsonl", run.out_dir);
    ckpt_root = run.out_dir + "/checkpoints";
  }
  const bool tty = isatty(STDERR_FILENO);
  if (run.progress) {
    fmt::print(stderr, "sigma train: {} parameters, {} domains, steps {}..{}, batch {}x{}x{}, {} threads\n",
               model.params().numel() + (experts ? experts->params() : 0), names.size(), state.step,
               last, cfg.train.accum, B, T, omp_get_max_threads());
    if (experts)
      fmt::print(stderr, "experts: {} ({} experts, {:.2f} GiB with Adam state, {})\n",
                 expert_mode_name(mode), experts->store().num_experts(),
                 double(experts->store().data_bytes()) / (1ull << 30),
                 experts->store().file_backed() ? "file " + experts->store().path() : "in RAM");
    if (!cfg.train.freeze.empty()) fmt::print(stderr, "{}\n", freeze.summary);
  }

  // The micro-batches of a step, with the sum of their masks; the model's domain indices.
  auto fetch = [&](std::vector<Batch>& mb, int64_t s) {
    double mask_total = 0;
    for (int m = 0; m < cfg.train.accum; ++m) {
      data->train_batch(mb[size_t(m)], B, T, uint64_t(s) * cfg.train.accum + m);
      for (float x : mb[size_t(m)].mask) mask_total += x;
      for (auto& d : mb[size_t(m)].domain) d = data_to_model[size_t(d)];
    }
    return mask_total;
  };
  std::vector<Batch> micro(size_t(cfg.train.accum)), next(size_t(cfg.train.accum));
  bool have_next = false;  // ECSS reads step t+1's batches during step t to prefetch experts
  double next_mask = 0;
  nlohmann::json cursor_after_step;  // the data cursor before step t+1's batches were read
  std::vector<float> token_loss(size_t(B) * T), scale(size_t(B) * T);
  DomainSums window(names.size());
  double aux_window = 0;  // learned gate: sum of the weighted load-balancing loss per micro-batch
  const auto t_start = Clock::now();
  int64_t tokens_this_run = 0, steps_this_run = 0, steps_in_window = 0;
  std::vector<BlockLoad> run_load = model.expert_load();  // zero counts, summed at each log
  model.reset_expert_load();

  for (int64_t step = state.step; step < last; ++step) {
    double mask_total;
    if (have_next) {
      std::swap(micro, next);
      mask_total = next_mask;
      have_next = false;
    } else {
      mask_total = fetch(micro, step);
    }
    const bool ckpt_now = !ckpt_root.empty() &&
                          ((cfg.train.ckpt_every > 0 && (step + 1) % cfg.train.ckpt_every == 0) ||
                           step + 1 == last);
    if (experts) {
      experts->begin_step(micro);
      if (step + 1 < last) {
        if (ckpt_now) cursor_after_step = data->cursor();
        next_mask = fetch(next, step + 1);
        have_next = true;
        experts->prefetch(next);
      }
    }
    model.params().zero_grad();
    for (auto& b : micro) {
      for (size_t i = 0; i < scale.size(); ++i) scale[i] = mask_total > 0 ? float(b.mask[i] / mask_total) : 0.0f;
      model.forward(b, token_loss.data(), scale.data());
      window.add(b, token_loss);
      aux_window += model.aux_loss() / cfg.train.accum;
    }
    UpdateMask mask = freeze.mask;
    if (cfg.optim.sparse_embeddings) limit_to_batch_rows(mask, model.params(), cfg.model, micro);
    if (!mask.all()) mask.mask_grads(model.params());
    const double norm =
        std::sqrt(AdamW::grad_sq(model.params()) + (experts ? experts->grad_sq() : 0.0));
    const float clip = (cfg.optim.grad_clip > 0 && norm > cfg.optim.grad_clip)
                           ? float(cfg.optim.grad_clip / norm) : 1.0f;
    const float lr = lr_at(cfg.optim, step, cfg.train.steps);
    opt.step(model.params(), lr, clip, &mask);
    if (experts) experts->end_step(lr, clip);
    state.step = step + 1;
    state.tokens += int64_t(cfg.train.accum) * B * T;
    tokens_this_run += int64_t(cfg.train.accum) * B * T;
    steps_this_run += 1;
    steps_in_window += 1;

    const bool log_now = state.step % cfg.train.log_every == 0 || state.step == last;
    if (log_now) {
      const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
      const double tps = tokens_this_run / std::max(elapsed, 1e-9);
      const double eta = elapsed / steps_this_run * double(last - state.step);
      if (run.progress)
        fmt::print(stderr, "{}step {:>6}/{} | loss {:.4f} | lr {:.2e} | |g| {:.3f} | {:.0f} tok/s | ETA {}{}",
                   tty ? "\r" : "", state.step, last, window.total_mean(), lr, norm, tps,
                   fmt_duration(eta), tty && state.step != last ? "   " : "\n");
      if (metrics.is_open()) {
        nlohmann::json dom = nlohmann::json::object();
        for (size_t d = 0; d < names.size(); ++d)
          if (window.count[d]) dom[names[d]] = window.loss[d] / double(window.count[d]);
        nlohmann::json rec{{"step", state.step}, {"loss", window.total_mean()},
                           {"lr", lr}, {"grad_norm", norm}, {"tokens", state.tokens},
                           {"tokens_per_s", tps}, {"domains", dom}};
        if (!model.expert_load().empty()) {  // tokens per expert over the logging window
          rec["expert_load"] = expert_load_json(model.expert_load(), cfg.model);
          rec["load_imbalance"] = load_imbalance_json(model.expert_load());
        }
        if (cfg.model.gated()) {  // the baseline's extra loss and its capacity drops
          rec["aux_loss"] = aux_window / double(steps_in_window);
          nlohmann::json dropped = nlohmann::json::object();
          for (const BlockLoad& b : model.expert_load()) dropped[std::to_string(b.block)] = b.dropped;
          rec["dropped"] = dropped;
        }
        metrics << rec.dump() << "\n";
        metrics.flush();
      }
      window = DomainSums(names.size());
      for (size_t b = 0; b < run_load.size(); ++b)
        for (size_t g = 0; g < run_load[b].tokens.size(); ++g)
          for (size_t e = 0; e < run_load[b].tokens[g].size(); ++e)
            run_load[b].tokens[g][e] += model.expert_load()[b].tokens[g][e];
      for (size_t b = 0; b < run_load.size(); ++b) run_load[b].dropped += model.expert_load()[b].dropped;
      aux_window = 0;
      steps_in_window = 0;
      model.reset_expert_load();
    }
    if (ckpt_now) {  // between steps: the store holds exactly this step's experts
      state.data_cursor = have_next ? cursor_after_step : data->cursor();
      save_checkpoint(ckpt_root, cfg, model, &opt, state, data->tokenizer_path(), experts.get());
    }
  }
  if (tty && run.progress) fmt::print(stderr, "\n");

  TrainSummary sum;
  sum.steps = state.step;
  sum.tokens = state.tokens;
  const double elapsed = std::chrono::duration<double>(Clock::now() - t_start).count();
  sum.tokens_per_s = steps_this_run ? tokens_this_run / std::max(elapsed, 1e-9) : 0.0;
  sum.expert_load = run_load;
  if (experts) {
    sum.expert_mode = expert_mode_name(mode);
    sum.offload = experts->stats();
  }
  sum.seconds = elapsed;
  std::unique_ptr<DataSource> held_out;
  if (!cfg.data.eval_path.empty())
    held_out = make_eval_source(cfg.data.eval_path, data->tokenizer_hash());
  sum.domains = evaluate(model, held_out ? *held_out : *data, B, T, cfg.train.eval_rows,
                         experts.get());
  if (!run.out_dir.empty()) {
    nlohmann::json dom = nlohmann::json::object();
    for (const auto& d : sum.domains) {
      dom[d.name] = {{"loss", d.loss}, {"tokens", d.tokens}};
      dom[d.name]["optimum"] = d.optimum ? nlohmann::json(*d.optimum) : nlohmann::json(nullptr);
    }
    std::ofstream out(run.out_dir + "/summary.json");
    nlohmann::json summary{{"steps", sum.steps}, {"tokens", sum.tokens},
                           {"tokens_per_s", sum.tokens_per_s}, {"domains", dom}};
    if (experts) {
      const OffloadStats& o = sum.offload;
      summary["ecss"] = {{"mode", sum.expert_mode}, {"store", cfg.train.expert_store},
                         {"gather_s", o.gather_s}, {"prefetch_wait_s", o.wait_s},
                         {"update_s", o.update_s}, {"train_s", sum.seconds},
                         {"experts_per_step", o.steps ? double(o.experts_updated) / o.steps : 0.0}};
    }
    if (!sum.expert_load.empty()) {
      summary["expert_load"] = expert_load_json(sum.expert_load, cfg.model);
      summary["load_imbalance"] = load_imbalance_json(sum.expert_load);
    }
    out << summary.dump(2) << "\n";
    SIGMA_CHECK(out.good(), "cannot write {}/summary.json", run.out_dir);
  }
  return sum;
}

}  // namespace sigma
