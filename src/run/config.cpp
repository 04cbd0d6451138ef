#include "run/config.h"

#include <algorithm>
#include <fstream>

#include "core/error.h"
#include "core/json_depth.h"
#include "kernels/ops.h"

namespace sigma {

namespace {
// A list of names: a JSON array of strings (--set 'key=["a","b"]') or one comma-separated string.
void add_name_list(Options& o, const std::string& key, std::vector<std::string>* v, std::string help) {
  o.add_json(
      key, std::move(help),
      [key, v](const nlohmann::json& j) {
        std::vector<std::string> out;
        if (j.is_string()) {
          std::string s = j.get<std::string>();
          for (size_t b = 0; b <= s.size();) {
            const size_t e = std::min(s.find(',', b), s.size());
            if (e > b) out.push_back(s.substr(b, e - b));
            b = e + 1;
          }
        } else {
          SIGMA_CHECK(j.is_array(), "config key '{}' must be a list of names", key);
          for (const auto& x : j) {
            SIGMA_CHECK(x.is_string() && !x.get<std::string>().empty(),
                        "config key '{}' must be a list of non-empty names, got {}", key, x.dump());
            out.push_back(x.get<std::string>());
          }
        }
        *v = std::move(out);
      },
      [v] { return nlohmann::json(*v); });
}
}  // namespace

void TrainConfig::describe(Options& o, const std::string& p) {
  o.add(p + "steps", &steps, "optimizer steps", 0, int64_t(1) << 40);
  o.add(p + "batch", &batch, "rows per micro-batch", 1, 1 << 20);
  o.add(p + "accum", &accum, "micro-batches per optimizer step (gradient accumulation; derived "
        "from train.global_batch when that is set)", 1, 1 << 16);
  o.add(p + "global_batch", &global_batch,
        "rows per optimizer step over all ranks (0 = train.batch x train.accum). Each rank runs "
        "an equal share of it as micro-batches of train.batch rows; mpirun -np R cuts them "
        "smaller when R ranks cannot share them as given (docs/distributed.md)", 0, 1 << 30);
  o.add(p + "seed", &seed, "seed of initialisation and data order");
  o.add(p + "log_every", &log_every, "steps between progress lines and metrics records", 1, 1 << 30);
  o.add(p + "eval_rows", &eval_rows, "held-out rows per domain for evaluation", 1, 1 << 24);
  o.add(p + "eval_every", &eval_every, "steps between held-out evaluations during the run, per "
        "domain, in metrics.jsonl (\"held_out\") and the progress line (0 = only at the end)", 0,
        int64_t(1) << 40);
  o.add(p + "ckpt_every", &ckpt_every, "steps between checkpoints (0 = only at the end)", 0,
        int64_t(1) << 40);
  o.add(p + "keep_checkpoints", &keep_checkpoints, "newest checkpoints kept in OUT/checkpoints; "
        "older ones are deleted once a newer one is committed (0 = keep all)", 0, int64_t(1) << 40);
  o.add(p + "keep_every", &keep_every, "with keep_checkpoints: also keep each checkpoint whose "
        "step is a multiple of this, as milestones (0 = none)", 0, int64_t(1) << 40);
  o.add(p + "ckpt_async", &ckpt_async, "write checkpoints on a background thread from a copy "
        "taken between two steps, so that the next steps run meanwhile (one process, or each rank "
        "with dist.ckpt_layout = sharded; at most one save in flight; the same files as false)");
  o.add(p + "threads", &threads, "CPU threads (0 = every core; more than the machine's cores are "
        "capped to them)", 0, 4096);
  o.add(p + "max_minutes", &max_minutes, "time limit in minutes from the start of sigma train (set-up included): "
        "the run stops after the step that passes it, with a checkpoint (the next step and save "
        "must fit in the scheduler's margin), and exits 0; every rank stops after the same step "
        "(0 = none)", 0, 1e7);
  o.add(p + "max_nonfinite_steps", &max_nonfinite_steps,
        "consecutive steps with a NaN/Inf loss or gradient norm that are skipped (no update) "
        "before the run stops with an error", 0, 1 << 20);
  o.add(p + "experts", &experts,
        "where RRE experts train: ecss (store on the host, only a step's active experts fetched "
        "and updated), vanilla (same store, every expert every step), model (in the model), "
        "parallel (each rank holds a share of every group's experts in its own store, rows "
        "exchanged inside the group), auto (ecss for routed sparse models on one rank, parallel "
        "on several, else model)",
        {"auto", "ecss", "vanilla", "model", "parallel"});
  o.add(p + "expert_store", &expert_store,
        "ECSS expert store file, memory-mapped so experts may exceed RAM (\"\" = in RAM)");
  o.add(p + "expert_memory", &expert_memory,
        "ECSS compute buffers for expert weights, e.g. 6GiB, 512MiB or bytes; a step whose "
        "active experts need more runs each RRE pass in slices (same results). auto = a quarter "
        "of physical memory");
  o.add(p + "backend", &backend,
        fmt::format("kernel backend of the ops front, one of {}: cpu (the fast kernels), ref "
                    "(naive loops accumulating in double, the tests' oracle; slow, for checking "
                    "a run), guard (the cpu kernels over memory host code cannot touch outside "
                    "an op: proves a run device-clean)", ops::backend_names()),
        ops::backend_list());
  o.add(p + "precision", &precision,
        "GEMM inputs of training and evaluation: fp32, or bf16 (inputs rounded to bf16, fp32 "
        "accumulation; master weights, Adam, softmax, LayerNorm and the loss stay fp32)",
        {"fp32", "bf16"});
  o.add(p + "remat", &remat,
        "activations backward recomputes instead of keeping (bit-identical results): none, "
        "attention (the attention outputs), blocks (everything but each block's input)",
        {"none", "attention", "blocks"});
  add_name_list(o, p + "freeze", &freeze,
                "parameter sets not to update: shared (all but the trained domains' experts and "
                "embedding slots), embeddings, experts, or a tensor-name prefix");
}

void DataConfig::describe(Options& o, const std::string& p) {
  o.add(p + "source", &source, "where training data comes from", {"synthetic", "shards"});
  o.add(p + "path", &path, "directory made by sigma prepare (source = shards)");
  o.add(p + "eval_path", &eval_path, "held-out directory made by sigma prepare (optional)");
  o.add(p + "tokenizer", &tokenizer, "tokenizer file (default: the one the shards were made with)");
  o.add(p + "finetune", &finetune, "one sample per row, padded with <Pad>, instead of packed windows");
  o.add(p + "mask_prompt", &mask_prompt, "fine-tuning: no loss on prompt tokens");
  add_name_list(o, p + "domains", &domains, "synthetic data: train on these domains only (empty = all)");
  o.add_json(
      p + "sampler", "domain weights and stages: {\"stages\": [{\"steps\": N, \"weights\": {...}}, ...]}",
      [this](const nlohmann::json& j) {
        SIGMA_CHECK(j.is_object(), "config key 'data.sampler' must be an object");
        sampler = j;
      },
      [this] { return sampler; });
}

void DistConfig::describe(Options& o, const std::string& p) {
  o.add(p + "timeout_s", &timeout_s,
        "seconds a rank waits in a collective before it ends the run (a peer died or hangs; "
        "0 = wait forever)", 0.0, 1e7);
  o.add(p + "ckpt_writers", &ckpt_writers,
        "ranks that write their checkpoint files at the same time", 1, 1 << 20);
  o.add(p + "ckpt_layout", &ckpt_layout,
        "how a run of several ranks saves: sharded (each rank writes its own tp slices, "
        "experts and optimizer shard, shard-IIII.{model,adam}.safetensors) or whole (each tp "
        "group assembles its tensors and experts whole: the files of a one-process run, which "
        "always saves whole); every command reads both, and either resumes at any layout",
        {"whole", "sharded"});
  o.add(p + "placement", &placement,
        "where expert groups live with train.experts = parallel: spread (every group over every "
        "rank) or by_group (each group on the ranks that run its micro-batches: micro-batch i of "
        "a step's accum draws its domains from group i * groups / accum, so rows never leave "
        "their group's ranks)",
        {"spread", "by_group"});
  o.add(p + "tp", &tp,
        "tensor (op-level) model parallelism: ranks per group that split every attention and "
        "dense FFN layer, and the embedding, tied head and loss by vocabulary (Megatron-style, "
        "adjacent ranks); the rank count must divide by it, and model.heads, the FFN width and "
        "model.vocab by tp", 1, 1 << 16);
  o.add(p + "zero", &zero,
        "ZeRO stage over the data-parallel ranks: 1 = each shared tensor's Adam state on one "
        "rank (its owner); 2 = its gradient too: each block's gradients go to their owners as "
        "soon as backward finishes them and the other ranks' copies are released (the same "
        "bits as 1); 3 = its value too: each rank keeps only the values it owns between steps and "
        "gathers each block's from their owners just before a pass reads it, releasing them after "
        "(the same bits as 1)", 1, 3);
  o.add(p + "overlap", &overlap,
        "hide ZeRO's exchanges behind compute: each block's gradients go to their owners as soon "
        "as backward finishes them, and the updated values come back while the next forward "
        "runs, each block's completed just before it is read (the same sums in the same order: "
        "the same bits as false, which exchanges after backward and after the update)");
  o.add(p + "overlap_mib", &overlap_mib,
        "with dist.overlap, the most MiB of exchange buffers (each round's packed copy and what it "
        "receives) a rank keeps in flight; past it the oldest round is completed first, so one "
        "round is always allowed (up to 32 MiB under ZeRO-1 and 2, 2 MiB under ZeRO-3: smaller "
        "values act as that). 0 = the default: 128 for ZeRO-1 and 2 (sized for a slow network), "
        "two of the largest block's rounds for ZeRO-3. Smaller saves memory and can expose more "
        "of the exchanges (docs/distributed.md has measured trade-offs); any value trains the "
        "same bits",
        0.0, 1048576.0);
}

Config::Config() {
  model.rre_layers = 2;
  model.groups = {{"markov", 2}, {"copy", 3}, {"arith", 4}};
}

Options Config::options() {
  Options o;
  model.describe(o, "model.");
  optim.describe(o, "optim.");
  train.describe(o, "train.");
  data.describe(o, "data.");
  dist.describe(o, "dist.");
  return o;
}

nlohmann::json Config::to_json() { return options().to_json(); }

void Config::apply(const nlohmann::json& j, const std::string& source) {
  options().apply_json(j, source);
}

void Config::load(const std::string& path, const std::vector<std::string>& sets) {
  Options o = options();
  if (!path.empty()) {
    std::ifstream in(path);
    SIGMA_CHECK(in.good(), "cannot open config file '{}'", path);
    nlohmann::json j = nlohmann::json::parse(in, json_depth_limit("config file '" + path + "'"), false);
    SIGMA_CHECK(!j.is_discarded(), "config file '{}' is not valid JSON", path);
    o.apply_json(j, path);
  }
  for (const auto& s : sets) o.apply_set(s);
}

}  // namespace sigma
