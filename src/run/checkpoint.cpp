#include "run/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>

#include "core/json_depth.h"
#include "io/checkpoint_dir.h"
#include "io/checkpoint_shards.h"
#include "kernels/ops.h"
#include "model/names.h"

namespace sigma {

namespace {
constexpr int64_t kMaxSteps = int64_t(1) << 40;  // train.steps' upper bound (run/config.cpp)

// Adds the tensors of `files` in `dir` to `st`: their index always, their data when `want`
// accepts the name. A name in two files is an error.
void merge_files(Safetensors& st, const std::string& dir, const std::vector<std::string>& files,
                 const std::function<bool(const std::string&)>& want) {
  for (const std::string& f : files) {
    Safetensors g = read_safetensors(dir + "/" + f, want);
    for (auto& [name, info] : g.index)
      SIGMA_CHECK(st.index.emplace(name, info).second, "{}/{}: tensor '{}' is also in another "
                  "file of the checkpoint", dir, f, name);
    for (auto& [name, t] : g.tensors) st.tensors.emplace(name, std::move(t));
  }
}
// The expert group files of an ECSS checkpoint (weights or Adam state).
void merge_group_files(Safetensors& st, const std::string& dir, bool adam,
                       const std::function<bool(const std::string&)>& want) {
  merge_files(st, dir, expert_group_files(dir, adam), want);
}
// optimizer.safetensors's siblings from a multi-rank run: the other ranks' shards.
void merge_optimizer_shards(Safetensors& st, const std::string& dir,
                            const std::function<bool(const std::string&)>& want) {
  merge_files(st, dir, optimizer_shard_files(dir), want);
}
}  // namespace

TensorMap read_model_tensors(const std::string& dir) {
  if (is_sharded_checkpoint(dir)) return std::move(read_sharded(dir, false).tensors);
  Safetensors st = read_safetensors(dir + "/" + kModelFile);
  merge_group_files(st, dir, /*adam=*/false, nullptr);
  return std::move(st.tensors);
}

TensorMap read_optimizer_tensors(const std::string& dir) {
  if (is_sharded_checkpoint(dir)) return std::move(read_sharded(dir, true).tensors);
  Safetensors st = read_safetensors(dir + "/" + kOptimizerFile);
  merge_optimizer_shards(st, dir, nullptr);
  merge_group_files(st, dir, /*adam=*/true, nullptr);
  return std::move(st.tensors);
}

int64_t checkpoint_model_bytes(const std::string& dir) {
  if (is_sharded_checkpoint(dir)) {
    int64_t n = 0;
    for (const std::string& f : sharded_files(dir, false))
      n += int64_t(std::filesystem::file_size(dir + "/" + f));
    return n;
  }
  int64_t n = int64_t(std::filesystem::file_size(dir + "/" + kModelFile));
  for (const std::string& f : expert_group_files(dir, false))
    n += int64_t(std::filesystem::file_size(dir + "/" + f));
  return n;
}

std::string read_checkpoint(const std::string& path,
                            const std::function<void(const std::string& dir)>& read) {
  for (int attempt = 1;; ++attempt) {
    const std::string dir = resolve_checkpoint(path);
    try {
      read(dir);
      return dir;
    } catch (const std::exception&) {
      if (attempt == 8 || dir == path) throw;
      std::error_code ec;
      if (std::filesystem::exists(dir, ec)) {
        // Still there: retention may be deleting it file by file (the root names a newer one
        // by then); an error of the checkpoint the root still names is the checkpoint's own.
        std::string now;
        try {
          now = resolve_checkpoint(path);
        } catch (const std::exception&) {
        }
        if (now.empty() || now == dir) throw;
      }
      fmt::print(stderr, "sigma: checkpoint '{}' was deleted while it was read (retention of a "
                 "live run); reading the one '{}' names now\n", dir, path);
    }
  }
}

namespace {
CheckpointInfo open_resolved(const std::string& dir) {
  CheckpointInfo info;
  info.dir = dir;
  verify_checkpoint(info.dir);
  const std::string tpath = info.dir + "/" + kTrainerFile;
  std::ifstream in(tpath);
  nlohmann::json j = parse_json_or_discard(in);
  SIGMA_CHECK(!j.is_discarded() && j.is_object(), "{}: not a JSON object (or nested deeper than "
              "{} levels)", tpath, kMaxJsonDepth);
  SIGMA_CHECK(j.contains("step") && j["step"].is_number_integer() && j.contains("config"),
              "{}: missing 'step' or 'config'", tpath);
  info.state.step = j["step"].get<int64_t>();
  info.state.tokens = j.value("tokens", int64_t(0));
  // A damaged step would silently skip (or repeat) the schedule and the data: it must be in
  // the range train.steps allows and agree with the directory's name.
  SIGMA_CHECK(info.state.step >= 0 && info.state.step <= kMaxSteps && info.state.tokens >= 0,
              "{}: step {} / tokens {} out of range (0..{} steps)", tpath, info.state.step,
              info.state.tokens, kMaxSteps);
  const std::string name = std::filesystem::path(info.dir).lexically_normal().filename().string();
  SIGMA_CHECK(!name.starts_with("step-") || name == fmt::format("step-{:08d}", info.state.step),
              "{}: says step {} but the checkpoint is '{}'", tpath, info.state.step, name);
  if (j.contains("data_cursor")) info.state.data_cursor = j["data_cursor"];
  if (j.contains("origin")) info.state.origin = j["origin"];
  info.cfg.apply(j["config"], tpath);
  return info;
}
}  // namespace

CheckpointInfo open_checkpoint(const std::string& path) {
  CheckpointInfo info;
  read_checkpoint(path, [&](const std::string& dir) { info = open_resolved(dir); });
  return info;
}

namespace {
// The tensor `t` read from `path` for a parameter held as `local` on this rank: checked
// against the whole shape, and cut to this rank's slice when the tp group splits it.
// `param` names the parameter (its split), `name` the tensor read (the parameter's, or its
// Adam moment's).
void upload_slice(Tensor& local, const Tensor& t, const std::string& param, const std::string& name,
                  const std::string& path, const TpGroup& tp, const ModelConfig& cfg) {
  const TpSplit split = tp.split() ? tp_split(cfg, param) : TpSplit{};
  Shape full = local.shape();
  if (!split.replicated()) full[size_t(split.dim)] *= tp.size;
  SIGMA_CHECK(t.dtype() == DType::F32 && t.shape() == full,
              "{}: tensor '{}' is {} {} but the model expects F32 {}", path, name,
              dtype_name(t.dtype()), shape_str(t.shape()), shape_str(full));
  check_finite(t, name, path);
  if (split.replicated()) return ops::upload(local, t.bytes(), t.nbytes());  // host bytes to the device
  Tensor mine(DType::F32, local.shape(), Device::Host);
  tp_slice(mine.f(), t.f(), full, split, tp.size, tp.rank);
  ops::upload(local, mine.bytes(), mine.nbytes());
}
}  // namespace

void load_model(Model& model, const std::string& dir) {
  const bool sharded = is_sharded_checkpoint(dir);
  const TensorSource src{sharded ? "" : dir + "/" + kModelFile, sharded ? dir : "", false};
  const std::string path = src.label();
  auto want = [&](const std::string& name) {
    return !model.external_experts() || !names::is_expert(name);
  };
  Safetensors st = src.read(want);
  SIGMA_CHECK(st.metadata.count("format") && st.metadata["format"] == kModelFormat,
              "{}: not a Sigma model file (metadata 'format' is not '{}')", path, kModelFormat);
  if (!sharded) merge_group_files(st, dir, /*adam=*/false, want);  // an ECSS run's expert groups
  for (Param& p : model.params().all()) {
    auto it = st.tensors.find(p.name);
    SIGMA_CHECK(it != st.tensors.end(), "{}: tensor '{}' is missing", path, p.name);
    upload_slice(p.value, it->second, p.name, p.name, path, model.tp(), model.config());
  }
  // Buffers (routing tables): checked against the model's vocabulary and expert counts.
  for (const Buffer& b : model.buffers().all()) {
    auto it = st.tensors.find(b.name);
    SIGMA_CHECK(it != st.tensors.end(), "{}: tensor '{}' is missing", path, b.name);
    try {
      model.load_buffer(b.name, it->second);
    } catch (const Error& e) {
      fail("{}: {}", path, e.what());
    }
  }
  size_t expected = model.params().all().size() + model.buffers().all().size();
  if (model.external_experts()) {  // read later by EcssExperts::load; here only counted
    const ModelConfig& cfg = model.config();
    for (int l = cfg.first_rre_block(); l < cfg.layers; ++l)
      for (const GroupSpec& g : cfg.groups)
        for (const char* leaf : names::kExpertLeaves) {
          SIGMA_CHECK(st.index.count(names::expert(l, g.name, leaf)),
                      "{}: tensor '{}' is missing", path, names::expert(l, g.name, leaf));
          ++expected;
        }
  }
  SIGMA_CHECK(st.index.size() == expected, "{}: holds {} tensors but the model has {}", path,
              st.index.size(), expected);
}

namespace {
void load_optimizer(AdamW& opt, const ParamSet& params, const std::string& dir, const TpGroup& tp,
                    const ModelConfig& cfg) {
  const bool sharded = is_sharded_checkpoint(dir);
  const TensorSource src{sharded ? "" : dir + "/" + kOptimizerFile, sharded ? dir : "", true};
  const std::string path = src.label();
  // Written without optimizer state (a surgery output: a new model at step 0; the manifest,
  // checked on open, says which files a checkpoint holds): training starts a fresh state.
  if (!src.exists()) return;
  // Expert state that is not in `params` (an expert store's) is left for EcssExperts::load.
  const bool has_experts = std::any_of(params.all().begin(), params.all().end(),
                                       [](const Param& p) { return p.expert; });
  auto want = [&](const std::string& name) { return has_experts || !names::is_expert(name); };
  // ZeRO-1: this rank reads only the state of the parameters it owns, from whichever rank's
  // file holds it (a checkpoint of R ranks resumes on any R').
  std::set<std::string> owned;
  for (size_t i = 0; i < params.all().size(); ++i)
    if (opt.owns(i)) owned.insert(params.all()[i].name);
  auto owned_name = [&](const std::string& name) {
    const size_t dot = name.rfind('.');
    return dot != std::string::npos && owned.count(name.substr(0, dot));
  };
  auto mine = [&](const std::string& name) { return want(name) && owned_name(name); };
  Safetensors st = src.read(mine);  // sharded: the pieces assembled whole
  if (!sharded) {
    merge_optimizer_shards(st, dir, mine);
    merge_group_files(st, dir, /*adam=*/true, mine);
  }
  const auto& ps = params.all();
  for (size_t i = 0; i < ps.size(); ++i) {
    if (!opt.owns(i)) continue;
    auto& s = opt.state()[i];
    for (auto [suffix, dst] : {std::pair{".m", &s.m}, std::pair{".v", &s.v}}) {
      auto it = st.tensors.find(ps[i].name + suffix);
      SIGMA_CHECK(it != st.tensors.end(), "{}: optimizer tensor '{}{}' is missing", path,
                  ps[i].name, suffix);
      if (!opt.owns_part(i)) {
        upload_slice(*dst, it->second, ps[i].name, ps[i].name + suffix, path, tp, cfg);
        continue;
      }
      // ZeRO cut this tensor into row runs (never a tp slice): this rank's rows of it.
      const Tensor& t = it->second;
      SIGMA_CHECK(t.dtype() == DType::F32 && t.shape() == ps[i].value.shape(),
                  "{}: tensor '{}{}' is {} {} but the model expects F32 {}", path, ps[i].name,
                  suffix, dtype_name(t.dtype()), shape_str(t.shape()), shape_str(ps[i].value.shape()));
      check_finite(t, ps[i].name + suffix, path);
      ops::upload(*dst, t.bytes() + size_t(opt.owned(i).begin) * sizeof(float), dst->nbytes());
    }
    auto it = st.tensors.find(ps[i].name + ".step");
    SIGMA_CHECK(it != st.tensors.end() && it->second.dtype() == DType::I64 &&
                    it->second.numel() == 1,
                "{}: optimizer step count '{}.step' is missing", path, ps[i].name);
    s.step = *it->second.data<int64_t>();
    auto rs = st.tensors.find(ps[i].name + ".row_steps");
    s.row_step.clear();
    if (rs != st.tensors.end()) {
      SIGMA_CHECK(rs->second.dtype() == DType::I64 && rs->second.numel() == ps[i].value.dim(0),
                  "{}: '{}.row_steps' must be I64 [{}]", path, ps[i].name, ps[i].value.dim(0));
      const int64_t* steps = rs->second.data<int64_t>();  // this rank's rows of them
      const int64_t first = opt.first_row(i), width = ps[i].value.numel() / ps[i].value.dim(0);
      s.row_step.assign(steps + first, steps + first + opt.owned(i).size() / width);
    }
  }
}
}  // namespace

void load_optimizer(AdamW& opt, const ParamSet& params, const std::string& dir) {
  load_optimizer(opt, params, dir, TpGroup{}, ModelConfig{});
}

void load_optimizer(AdamW& opt, const Model& model, const std::string& dir) {
  load_optimizer(opt, model.params(), dir, model.tp(), model.config());
}

std::unique_ptr<Model> load_checkpoint_model(const std::string& path, CheckpointInfo* info) {
  CheckpointInfo ck;
  std::unique_ptr<Model> model;
  read_checkpoint(path, [&](const std::string& dir) {
    ck = open_resolved(dir);
    model = Model::for_loading(ck.cfg.model, ck.cfg.train.seed);
    load_model(*model, ck.dir);
  });
  if (info) *info = std::move(ck);
  return model;
}

std::optional<nlohmann::json> checkpoint_data_domains(const std::string& dir) {
  std::ifstream in(dir + "/" + kDataDomainsFile);
  if (!in) return std::nullopt;
  const auto j = parse_json_or_discard(in);
  SIGMA_CHECK(!j.is_discarded() && j.is_object() && j.contains("domains") && j["domains"].is_array(),
              "{}/{}: not a data registry ({{\"domains\": [...]}})", dir, kDataDomainsFile);
  return j["domains"];
}

std::string checkpoint_tokenizer_path(const std::string& dir) {
  const std::string p = dir + "/" + kTokenizerFile;
  return std::filesystem::exists(p) ? p : "";
}

}  // namespace sigma
