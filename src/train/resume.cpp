#include "train/resume.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "data/tokenizer.h"
#include "optim/adamw.h"

namespace sigma {

namespace {
// A JSON value for a message: short values whole, long ones (a list of groups) cut.
std::string short_value(const nlohmann::json& v) {
  if (v.is_null()) return "absent";
  std::string s = v.dump();
  return s.size() <= 40 ? s : s.substr(0, 37) + "...";
}
}  // namespace

std::string model_difference(const Config& was, const Config& now) {
  Config a = was, b = now;
  const nlohmann::json ja = a.to_json()["model"].flatten(), jb = b.to_json()["model"].flatten();
  std::vector<std::string> keys;  // JSON pointers such as /groups/1/experts, in key order
  for (const auto& [k, v] : ja.items())
    if (!jb.contains(k) || jb[k] != v) keys.push_back(k);
  for (const auto& [k, v] : jb.items())
    if (!ja.contains(k)) keys.push_back(k);
  if (keys.empty()) return "";
  auto name = [](std::string k) {  // /groups/1/experts -> model.groups[1].experts
    std::string out = "model";
    for (size_t i = 1, j; i <= k.size(); i = j + 1) {
      j = std::min(k.find('/', i), k.size());
      const std::string part = k.substr(i, j - i);
      const bool index = !part.empty() && part.find_first_not_of("0123456789") == std::string::npos;
      out += index ? "[" + part + "]" : "." + part;
    }
    return out;
  };
  auto value = [](const nlohmann::json& j, const std::string& k) {
    return j.contains(k) ? short_value(j[k]) : std::string("absent");
  };
  std::string s = fmt::format("{} is {} here but {} in the checkpoint", name(keys[0]),
                              value(jb, keys[0]), value(ja, keys[0]));
  std::vector<std::string> more;
  for (size_t i = 1; i < keys.size() && i < 4; ++i) more.push_back(name(keys[i]));
  if (keys.size() > 4) more.push_back(fmt::format("{} more", keys.size() - 4));
  if (!more.empty()) s += fmt::format(" (also {})", fmt::join(more, ", "));
  return s;
}

Config resume_config(const Config& checkpoint, const std::string& config_file,
                     const std::vector<std::string>& sets) {
  Config cfg = checkpoint;
  if (!config_file.empty()) {
    cfg.load(config_file, {});
    const std::string diff = model_difference(checkpoint, cfg);
    SIGMA_CHECK(diff.empty(), "{}: {}: a resumed run keeps the checkpoint's model (drop the "
                "model keys from the file, or give them the checkpoint's values)", config_file, diff);
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
  const std::string now = fmt::format("{:.4g}", lr_at(b, step, after.train.steps));
  const std::string was = fmt::format("{:.4g}", lr_at(a, step, before.train.steps));
  // Inside the warmup, or where the two cosines cross, the next step's lr is the same.
  std::string s = fmt::format(
      "resuming after step {}, the learning-rate schedule changes: {}; step {} trains at lr {}{}",
      step, fmt::join(changed, ", "), step + 1, now,
      now == was ? " as before, later steps differ" : " instead of " + was);
  if (ta != tb) s += fmt::format(" (to keep the original schedule, add --set optim.schedule_steps={})", ta);
  return s;
}

void check_resume_tokenizer(const CheckpointInfo& ck, const DataSource& data, const Config& cfg) {
  const std::string other = tokenizer_mismatch(ck.dir, data, cfg.data.path);
  if (other.empty()) return;
  // A grown vocabulary (inherit --tokenizer) keeps the data.path of the dense run, whose shards
  // hold the old tokenizer's ids: valid ids, but never the new tokens the model was grown for.
  const uint32_t ids = data::Tokenizer::load(checkpoint_tokenizer_path(ck.dir)).vocab_size();
  const bool grown = ids > uint32_t(data.vocab());
  const std::string eval = cfg.data.eval_path.empty() ? "" : " --set data.eval_path=NEW_HELDOUT";
  fail("sigma train --resume: {}{}. Prepare the corpus again with the checkpoint's tokenizer: in "
       "the data config given to sigma prepare set \"tokenizer\" to (a copy of) {}, run sigma "
       "prepare --config DATA.json --out NEW_SHARDS{}, then sigma train --resume {} --set "
       "data.path=NEW_SHARDS{}", other,
       grown ? fmt::format(" (the checkpoint's vocabulary, {} ids, was grown by sigma inherit "
                           "--tokenizer; data.path = {} still holds the old tokenizer's shards)",
                           ids, cfg.data.path)
             : "",
       checkpoint_tokenizer_path(ck.dir),
       eval.empty() ? "" : " (and the held-out config, --out NEW_HELDOUT)", ck.dir, eval);
}

}  // namespace sigma
