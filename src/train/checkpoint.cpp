#include "train/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>

#include "core/json_depth.h"
#include "io/checkpoint_dir.h"
#include "io/safetensors.h"
#include "model/names.h"

namespace sigma {

namespace {
constexpr const char* kFormat = "sigma-model";
constexpr const char* kTokenizerFile = "tokenizer.json";
constexpr int64_t kMaxSteps = int64_t(1) << 40;  // train.steps' upper bound (train/config.cpp)
}  // namespace

namespace {

// The Adam state of the parameters `opt` owns, under "<name>.m", ".v", ".step" and
// ".row_steps" (lazy rows); `keep` holds the step scalars until they are written.
std::vector<TensorRef> optimizer_refs(const Model& model, const AdamW& opt, std::vector<Tensor>& keep) {
  std::vector<TensorRef> state;
  const auto& ps = model.params().all();
  keep.reserve(2 * ps.size());  // TensorRefs point into it: no reallocation
  for (size_t i = 0; i < ps.size(); ++i) {
    if (!opt.owns(i)) continue;
    const auto& s = opt.state()[i];
    state.push_back(tensor_ref(ps[i].name + ".m", s.m));
    state.push_back(tensor_ref(ps[i].name + ".v", s.v));
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    if (!opt.owns(i)) continue;
    keep.emplace_back(DType::I64, Shape{});
    *keep.back().data<int64_t>() = opt.state()[i].step;
    state.push_back(tensor_ref(ps[i].name + ".step", keep.back()));
  }
  for (size_t i = 0; i < ps.size(); ++i) {  // lazy row updates: a step count per row
    const auto& rs = opt.state()[i].row_step;
    if (!opt.owns(i) || rs.empty()) continue;
    keep.emplace_back(DType::I64, Shape{int64_t(rs.size())});
    std::copy(rs.begin(), rs.end(), keep.back().data<int64_t>());
    state.push_back(tensor_ref(ps[i].name + ".row_steps", keep.back()));
  }
  return state;
}

std::string broadcast_string(Communicator& comm, std::string s) {
  uint64_t n = s.size();
  comm.broadcast(&n, sizeof n, 0);
  s.resize(size_t(n));
  comm.broadcast(s.data(), size_t(n), 0);
  return s;
}

// The domains of the data the model was trained on: the prepared shards' manifest.json (a run
// on shards), else data_domains.json beside the tokenizer (a checkpoint made from another
// checkpoint, as surgery passes the tokenizer on).
std::optional<nlohmann::json> data_domains_of(const Config& cfg, const std::string& tokenizer_path) {
  std::vector<std::filesystem::path> files;
  if (cfg.data.source == "shards" && !cfg.data.path.empty())
    files.push_back(std::filesystem::path(cfg.data.path) / "manifest.json");
  if (!tokenizer_path.empty())
    files.push_back(std::filesystem::path(tokenizer_path).parent_path() / kDataDomainsFile);
  for (const auto& f : files) {
    std::ifstream in(f);
    if (!in) continue;
    const auto j = parse_json_or_discard(in);
    if (!j.is_discarded() && j.is_object() && j.contains("domains") && j["domains"].is_array())
      return j["domains"];
  }
  return std::nullopt;
}

// Rank 0's files: the model, its optimizer shard, the trainer state, tokenizer and experts.
void write_rank0_files(CheckpointWriter& w, Config& cfg, const Model& model, const AdamW* opt,
                       const TrainerState& st, const std::string& tokenizer_path,
                       const ExpertFiles* experts) {
  const nlohmann::json config = cfg.to_json();
  std::vector<TensorRef> params;
  for (const Param& p : model.params().all()) params.push_back(tensor_ref(p.name, p.value));
  for (const Buffer& b : model.buffers().all()) params.push_back(tensor_ref(b.name, b.value));
  w.add_safetensors(kModelFile, params,
                    {{"format", kFormat}, {"version", "1"}, {"config", config.dump()}});
  std::vector<Tensor> keep;
  if (opt)
    w.add_safetensors(kOptimizerFile, optimizer_refs(model, *opt, keep),
                      {{"format", "sigma-adamw"}, {"version", "1"}});
  w.add_json(kTrainerFile, {{"step", st.step}, {"tokens", st.tokens}, {"config", config},
                            {"data_cursor", st.data_cursor}});
  if (!tokenizer_path.empty()) w.add_file_copy(kTokenizerFile, tokenizer_path);
  if (const auto domains = data_domains_of(cfg, tokenizer_path))
    w.add_json(kDataDomainsFile, {{"domains", *domains}});
  if (experts) experts->add_checkpoint_files(w);
}

// The files each rank r > 0 writes, in an order every rank knows.
std::vector<std::vector<std::string>> peer_files(int R, bool optimizer, const ExpertFiles* experts) {
  std::vector<std::vector<std::string>> files(static_cast<size_t>(R));
  for (int r = 1; r < R; ++r) {
    if (optimizer) files[size_t(r)].push_back(optimizer_shard_file(r));
    if (experts)
      for (std::string& f : experts->files_of_rank(r)) files[size_t(r)].push_back(std::move(f));
  }
  return files;
}

// Each peer's (size, checksum) of each of its files to rank 0's manifest, as four exact
// 32-bit halves per file in one all-gather.
void record_peer_files(Communicator& c, CheckpointWriter& w,
                       const std::vector<std::vector<std::string>>& files) {
  const int R = c.size(), me = c.rank();
  size_t most = 0;
  for (const auto& f : files) most = std::max(most, f.size());
  if (most == 0) return;
  std::vector<double> mine(4 * most, 0.0), all(4 * most * size_t(R));
  for (size_t i = 0; me != 0 && i < files[size_t(me)].size(); ++i) {
    const auto [size, sum] = w.recorded(files[size_t(me)][i]);
    double* v = mine.data() + 4 * i;
    v[0] = double(size >> 32), v[1] = double(size & 0xffffffffu);
    v[2] = double(sum >> 32), v[3] = double(sum & 0xffffffffu);
  }
  c.all_gather(all.data(), mine.data(), int64_t(mine.size()));
  for (int r = 1; me == 0 && r < R; ++r)
    for (size_t i = 0; i < files[size_t(r)].size(); ++i) {
      const double* v = all.data() + 4 * (most * size_t(r) + i);
      w.add_peer_file(files[size_t(r)][i], (uint64_t(v[0]) << 32) | uint64_t(v[1]),
                      (uint64_t(v[2]) << 32) | uint64_t(v[3]));
    }
}

}  // namespace

std::string save_checkpoint(const std::string& root, Config& cfg, const Model& model,
                            const AdamW* opt, const TrainerState& st,
                            const std::string& tokenizer_path, ExpertFiles* experts,
                            Communicator* comm) {
  SingleProcess one;
  Communicator& c = comm ? *comm : one;
  const int R = c.size(), me = c.rank();
  const std::string name = fmt::format("step-{:08d}", st.step);
  if (experts) experts->collect();  // each expert group comes to the rank writing it
  std::optional<CheckpointWriter> w;
  if (me == 0) w.emplace(root, name);
  const std::string tmp = R > 1 ? broadcast_string(c, me == 0 ? w->temp_dir() : "") : w->temp_dir();
  if (me != 0) w.emplace(CheckpointWriter::peer(tmp));
  // Ranks write in waves of dist.ckpt_writers, so that R ranks do not all hit the disk at once.
  const int writers = std::max(1, cfg.dist.ckpt_writers);
  for (int wave = 0; wave * writers < R; ++wave) {
    if (me / writers == wave) {
      if (me == 0) write_rank0_files(*w, cfg, model, opt, st, tokenizer_path, experts);
      else {
        if (opt) {
          std::vector<Tensor> keep;
          w->add_safetensors(optimizer_shard_file(me), optimizer_refs(model, *opt, keep),
                             {{"format", "sigma-adamw"}, {"version", "1"}});
        }
        if (experts) experts->add_checkpoint_files(*w);
      }
    }
    if (R > 1) c.barrier();
  }
  if (R > 1) record_peer_files(c, *w, peer_files(R, opt != nullptr, experts));
  std::string dir = (std::filesystem::path(root) / name).string();
  if (me == 0) dir = w->commit();
  if (R > 1) c.barrier();  // nobody reads or writes the next one before this one is in place
  if (experts) experts->checkpoint_written(dir);
  return dir;
}

namespace {
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
  Safetensors st = read_safetensors(dir + "/" + kModelFile);
  merge_group_files(st, dir, /*adam=*/false, nullptr);
  return std::move(st.tensors);
}

TensorMap read_optimizer_tensors(const std::string& dir) {
  Safetensors st = read_safetensors(dir + "/" + kOptimizerFile);
  merge_optimizer_shards(st, dir, nullptr);
  merge_group_files(st, dir, /*adam=*/true, nullptr);
  return std::move(st.tensors);
}

int64_t checkpoint_model_bytes(const std::string& dir) {
  int64_t n = int64_t(std::filesystem::file_size(dir + "/" + kModelFile));
  for (const std::string& f : expert_group_files(dir, false))
    n += int64_t(std::filesystem::file_size(dir + "/" + f));
  return n;
}

CheckpointInfo open_checkpoint(const std::string& path) {
  CheckpointInfo info;
  info.dir = resolve_checkpoint(path);
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
  info.cfg.apply(j["config"], tpath);
  return info;
}

void load_model(Model& model, const std::string& dir) {
  const std::string path = dir + "/" + kModelFile;
  auto want = [&](const std::string& name) {
    return !model.external_experts() || !names::is_expert(name);
  };
  Safetensors st = read_safetensors(path, want);
  SIGMA_CHECK(st.metadata.count("format") && st.metadata["format"] == kFormat,
              "{}: not a Sigma model file (metadata 'format' is not '{}')", path, kFormat);
  merge_group_files(st, dir, /*adam=*/false, want);  // an ECSS run's expert groups
  for (Param& p : model.params().all()) {
    auto it = st.tensors.find(p.name);
    SIGMA_CHECK(it != st.tensors.end(), "{}: tensor '{}' is missing", path, p.name);
    const Tensor& t = it->second;
    SIGMA_CHECK(t.dtype() == DType::F32 && t.shape() == p.value.shape(),
                "{}: tensor '{}' is {} {} but the model expects F32 {}", path, p.name,
                dtype_name(t.dtype()), shape_str(t.shape()), shape_str(p.value.shape()));
    check_finite(t, p.name, path);
    std::memcpy(p.value.bytes(), t.bytes(), t.nbytes());
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

void load_optimizer(AdamW& opt, const ParamSet& params, const std::string& dir) {
  const std::string path = dir + "/" + kOptimizerFile;
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
  Safetensors st = read_safetensors(path, mine);
  merge_optimizer_shards(st, dir, mine);
  merge_group_files(st, dir, /*adam=*/true, mine);
  const auto& ps = params.all();
  for (size_t i = 0; i < ps.size(); ++i) {
    if (!opt.owns(i)) continue;
    auto& s = opt.state()[i];
    for (auto [suffix, dst] : {std::pair{".m", &s.m}, std::pair{".v", &s.v}}) {
      auto it = st.tensors.find(ps[i].name + suffix);
      SIGMA_CHECK(it != st.tensors.end() && it->second.dtype() == DType::F32 &&
                      it->second.shape() == dst->shape(),
                  "{}: optimizer tensor '{}{}' is missing or has the wrong shape", path,
                  ps[i].name, suffix);
      check_finite(it->second, ps[i].name + suffix, path);
      std::memcpy(dst->bytes(), it->second.bytes(), dst->nbytes());
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
      s.row_step.assign(rs->second.data<int64_t>(), rs->second.data<int64_t>() + rs->second.numel());
    }
  }
}

std::unique_ptr<Model> load_checkpoint_model(const std::string& path, CheckpointInfo* info) {
  CheckpointInfo ck = open_checkpoint(path);
  auto model = Model::for_loading(ck.cfg.model, ck.cfg.train.seed);
  load_model(*model, ck.dir);
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
