#include "train/resume.h"

#include <fmt/format.h>

#include <filesystem>
#include <vector>

#include "core/error.h"
#include "optim/adamw.h"

namespace sigma {

Config resume_config(const Config& checkpoint, const std::string& config_file,
                     const std::vector<std::string>& sets) {
  Config cfg = checkpoint;
  if (!config_file.empty()) {
    cfg.load(config_file, {});
    Config ck = checkpoint;
    const nlohmann::json was = ck.to_json()["model"], now = cfg.to_json()["model"];
    for (const auto& [key, value] : now.items())
      SIGMA_CHECK(was[key] == value, "{} sets model.{} = {} but the checkpoint has {}: a resumed "
                  "run keeps the checkpoint's model (drop the model keys from the file, or give "
                  "them the checkpoint's values)", config_file, key, value.dump(), was[key].dump());
  }
  cfg.load("", sets);
  return cfg;
}

bool make_store_path_absolute(Config& c) {
  std::string& p = c.train.expert_store;
  if (p.empty() || std::filesystem::path(p).is_absolute()) return false;
  p = std::filesystem::absolute(p).lexically_normal().string();
  return true;
}

void make_data_paths_absolute(Config& c) {
  for (std::string* p : {&c.data.path, &c.data.eval_path, &c.data.tokenizer})
    if (!p->empty() && !std::filesystem::path(*p).is_absolute())
      *p = std::filesystem::absolute(*p).lexically_normal().string();
}

int64_t schedule_total(const Config& c) {
  return c.optim.schedule_steps > 0 ? c.optim.schedule_steps : c.train.steps;
}

std::string schedule_change(const Config& before, const Config& after, int64_t step) {
  if (step <= 0) return "";
  const OptimConfig &a = before.optim, &b = after.optim;
  const int64_t ta = schedule_total(before), tb = schedule_total(after);
  std::vector<std::string> changed;
  if (ta != tb)
    changed.push_back(fmt::format("cosine over {} steps instead of {} ({})", tb, ta,
                                  a.schedule_steps != b.schedule_steps ? "optim.schedule_steps"
                                                                       : "train.steps"));
  if (a.lr != b.lr) changed.push_back(fmt::format("optim.lr {} -> {}", a.lr, b.lr));
  if (a.warmup != b.warmup) changed.push_back(fmt::format("optim.warmup {} -> {}", a.warmup, b.warmup));
  if (a.min_lr_ratio != b.min_lr_ratio)
    changed.push_back(fmt::format("optim.min_lr_ratio {} -> {}", a.min_lr_ratio, b.min_lr_ratio));
  if (changed.empty()) return "";
  // Step `step` (0-based) is the one metrics.jsonl and the progress line call step + 1.
  std::string s = fmt::format(
      "resuming after step {}, the learning-rate schedule changes: {}; step {} trains at lr "
      "{:.4g} instead of {:.4g}", step, fmt::join(changed, ", "), step + 1,
      lr_at(b, step, after.train.steps), lr_at(a, step, before.train.steps));
  if (ta != tb) s += fmt::format(" (to keep the original schedule, add --set optim.schedule_steps={})", ta);
  return s;
}

}  // namespace sigma
