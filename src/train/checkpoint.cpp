#include "train/checkpoint.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>

#include "core/json_depth.h"
#include "io/checkpoint_dir.h"
#include "io/safetensors.h"
#include "kernels/ops.h"
#include "train/checkpoint_sharded.h"

namespace sigma {

namespace {

// The Adam state of the parameters `opt` owns, under "<name>.m", ".v", ".step" and
// ".row_steps" (lazy rows); `keep` holds the step scalars until they are written.
// A tensor's bytes on the host for the writer (checkpoint files are host memory): a host
// tensor as it is, a device tensor downloaded into `keep` (a moved Tensor keeps its buffer, so
// the ref stays valid as `keep` grows).
TensorRef host_ref(std::string name, const Tensor& t, std::vector<Tensor>& keep) {
  if (t.device() == Device::Host) return tensor_ref(std::move(name), t);
  keep.push_back(ops::to_host(t));
  return tensor_ref(std::move(name), keep.back());
}

// Tensor parallelism: the whole tensors a checkpoint holds, assembled from the tp group's
// slices (model/tensor_parallel.h), so that the files are those of the same model at tp = 1
// and resume at any tp. value: every parameter (only data rank 0's group writes the model);
// m, v: the Adam moments of the parameters this data rank owns. Host tensors; a tensor left
// empty is read from the model or optimizer as it is (replicated, or not needed).
// ZeRO's cut tensors (parallel/shard_plan.h) are assembled alike over the data group, on the
// rank owning their first rows, which writes them (skip[i]: another rank does).
struct WholeTensors {
  std::vector<Tensor> value, m, v;  // [params]
  std::vector<std::vector<int64_t>> row_step;  // [params]: lazy rows' step counts, assembled
  std::vector<uint8_t> skip;  // [params]
};

// The Adam state of the tensors ZeRO cut into row runs, assembled whole on the first rows'
// owner: each owner broadcasts its rows in turn (every rank of `data` calls it).
void gather_cut_state(Communicator& data, const Model& model, const AdamW& opt, WholeTensors& w) {
  const auto& ps = model.params().all();
  const size_t n = ps.size(), R = size_t(data.size());
  w.m.resize(n), w.v.resize(n), w.row_step.resize(n), w.skip.assign(n, 0);
  if (R == 1) return;
  std::vector<double> mine(2 * n), all(2 * n * R);  // per param: owned elements, lazy rows
  for (size_t i = 0; i < n; ++i) {
    mine[2 * i] = double(opt.owned(i).size());
    mine[2 * i + 1] = opt.owns(i) && !opt.state()[i].row_step.empty();
  }
  data.all_gather(all.data(), mine.data(), 2 * n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t numel = ps[i].value.numel(), width = numel / std::max<int64_t>(1, ps[i].value.dim(0));
    std::vector<int64_t> count(R);
    bool cut = false, lazy = false;
    for (size_t r = 0; r < R; ++r) {
      count[r] = int64_t(all[2 * (r * n + i)]);
      cut = cut || (count[r] > 0 && count[r] < numel);
      lazy = lazy || all[2 * (r * n + i) + 1] != 0;
    }
    if (!cut) continue;
    const size_t first = size_t(std::find_if(count.begin(), count.end(), [](int64_t c) { return c > 0; }) -
                                count.begin());
    const AdamW::State& s = opt.state()[i];
    // Each owner's elements, at its offset (the plan's cuts ascend with the rank).
    auto assemble = [&](std::byte* whole, size_t es, const std::byte* own) {
      int64_t at = 0;
      for (size_t r = 0; r < R; ++r) {
        if (count[r] == 0) continue;
        const size_t bytes = size_t(count[r]) * es;
        if (int(r) == data.rank()) std::memcpy(whole + size_t(at) * es, own, bytes);
        data.broadcast(whole + size_t(at) * es, bytes, int(r));
        at += count[r];
      }
    };
    for (auto [dst, src] : {std::pair{&w.m[i], &s.m}, std::pair{&w.v[i], &s.v}}) {
      Tensor whole(DType::F32, ps[i].value.shape(), Device::Host);
      const Tensor own = opt.owns(i) ? ops::to_host(*src) : Tensor{};
      assemble(whole.bytes(), sizeof(float), opt.owns(i) ? own.bytes() : nullptr);
      if (size_t(data.rank()) == first) *dst = std::move(whole);
    }
    if (lazy) {
      std::vector<int64_t> rows(size_t(numel / width));
      for (int64_t& c : count) c /= width;
      assemble(reinterpret_cast<std::byte*>(rows.data()), sizeof(int64_t),
               reinterpret_cast<const std::byte*>(s.row_step.data()));
      if (size_t(data.rank()) == first) w.row_step[i] = std::move(rows);
    }
    w.skip[i] = size_t(data.rank()) != first;
  }
}

// Every rank of the tp group calls it for the same tensors in the same order (collective).
Tensor gather_whole(Communicator& tp, const TpSplit split, const Tensor& local) {
  Tensor mine = ops::to_host(local);
  if (split.replicated()) return mine;
  Shape full = local.shape();
  full[size_t(split.dim)] *= tp.size();
  const int64_t n = local.numel();
  std::vector<float> all(size_t(n) * size_t(tp.size()));
  tp.all_gather(all.data(), mine.f(), size_t(n));
  std::vector<const float*> parts;
  for (int r = 0; r < tp.size(); ++r) parts.push_back(all.data() + int64_t(r) * n);
  Tensor whole(DType::F32, full, Device::Host);
  tp_assemble(whole.f(), parts.data(), full, split, tp.size());
  return whole;
}

WholeTensors gather_whole_tensors(Communicator& tp, bool model_file, const Model& model,
                                  const AdamW* opt) {
  const auto& ps = model.params().all();
  WholeTensors w;
  w.value.resize(ps.size()), w.m.resize(ps.size()), w.v.resize(ps.size());
  for (size_t i = 0; i < ps.size(); ++i) {
    const TpSplit split = tp_split(model.config(), ps[i].name);
    if (split.replicated()) continue;
    if (model_file) w.value[i] = gather_whole(tp, split, ps[i].value);
    if (opt && opt->owns(i)) {
      w.m[i] = gather_whole(tp, split, opt->state()[i].m);
      w.v[i] = gather_whole(tp, split, opt->state()[i].v);
    }
  }
  return w;
}

// t, or its whole assembled copy when there is one.
const Tensor& whole_or(const std::vector<Tensor>* whole, size_t i, const Tensor& t) {
  return whole && i < whole->size() && (*whole)[i].numel() ? (*whole)[i] : t;
}

std::vector<TensorRef> optimizer_refs(const Model& model, const AdamW& opt, std::vector<Tensor>& keep,
                                      const WholeTensors* whole) {
  std::vector<TensorRef> state;
  const auto& ps = model.params().all();
  keep.reserve(2 * ps.size());  // TensorRefs point into it: no reallocation
  auto writes = [&](size_t i) { return opt.owns(i) && !(whole && !whole->skip.empty() && whole->skip[i]); };
  for (size_t i = 0; i < ps.size(); ++i) {
    if (!writes(i)) continue;
    const auto& s = opt.state()[i];
    state.push_back(host_ref(ps[i].name + ".m", whole_or(whole ? &whole->m : nullptr, i, s.m), keep));
    state.push_back(host_ref(ps[i].name + ".v", whole_or(whole ? &whole->v : nullptr, i, s.v), keep));
  }
  for (size_t i = 0; i < ps.size(); ++i) {
    if (!writes(i)) continue;
    keep.emplace_back(DType::I64, Shape{});
    *keep.back().data<int64_t>() = opt.state()[i].step;
    state.push_back(tensor_ref(ps[i].name + ".step", keep.back()));
  }
  for (size_t i = 0; i < ps.size(); ++i) {  // lazy row updates: a step count per row
    const auto& rs = whole && !whole->row_step.empty() && !whole->row_step[i].empty()
                         ? whole->row_step[i] : opt.state()[i].row_step;
    if (!writes(i) || rs.empty()) continue;
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

// The trainer state, the tokenizer and the data registry (rank 0's, whatever the layout).
template <class W>
void write_run_files(W& w, Config& cfg, const TrainerState& st, const std::string& tokenizer_path) {
  nlohmann::json trainer{{"step", st.step}, {"tokens", st.tokens}, {"config", cfg.to_json()},
                         {"data_cursor", st.data_cursor}};
  if (!st.origin.is_null()) trainer["origin"] = st.origin;
  w.add_json(kTrainerFile, trainer);
  if (!tokenizer_path.empty()) w.add_file_copy(kTokenizerFile, tokenizer_path);
  if (const auto domains = data_domains_of(cfg, tokenizer_path))
    w.add_json(kDataDomainsFile, {{"domains", *domains}});
}

// Rank 0's files: the model, its optimizer shard, the trainer state and tokenizer (experts:
// the caller). W: a CheckpointWriter, or a SaveSnapshot that writes them later.
template <class W>
void write_rank0_files(W& w, Config& cfg, const Model& model, const AdamW* opt,
                       const TrainerState& st, const std::string& tokenizer_path,
                       const WholeTensors* whole) {
  const nlohmann::json config = cfg.to_json();
  std::vector<TensorRef> params;
  std::vector<Tensor> keep;
  const auto& ps = model.params().all();
  keep.reserve(3 * ps.size());  // TensorRefs point into it: no reallocation
  for (size_t i = 0; i < ps.size(); ++i)
    params.push_back(host_ref(ps[i].name, whole_or(whole ? &whole->value : nullptr, i, ps[i].value), keep));
  for (const Buffer& b : model.buffers().all()) params.push_back(tensor_ref(b.name, b.value));
  w.add_safetensors(kModelFile, params,
                    {{"format", kModelFormat}, {"version", "1"}, {"config", config.dump()}});
  if (opt)
    w.add_safetensors(kOptimizerFile, optimizer_refs(model, *opt, keep, whole),
                      {{"format", "sigma-adamw"}, {"version", "1"}});
  write_run_files(w, cfg, st, tokenizer_path);
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

std::string checkpoint_name(int64_t step) { return fmt::format("step-{:08d}", step); }

void add_run_files(CheckpointWriter& w, Config& cfg, const TrainerState& st,
                   const std::string& tokenizer_path) {
  write_run_files(w, cfg, st, tokenizer_path);
}

void add_run_files(SaveSnapshot& s, Config& cfg, const TrainerState& st,
                   const std::string& tokenizer_path) {
  write_run_files(s, cfg, st, tokenizer_path);
}

void snapshot_checkpoint(SaveSnapshot& files, Config& cfg, const Model& model, const AdamW* opt,
                         const TrainerState& st, const std::string& tokenizer_path,
                         EcssExperts* experts) {
  write_rank0_files(files, cfg, model, opt, st, tokenizer_path, nullptr);
  if (experts) files.add_first(experts->checkpoint_later());
}

bool saves_sharded(const Config& cfg, int ranks, const ExpertFiles* experts) {
  return cfg.dist.ckpt_layout == "sharded" && ranks > 1 && (!experts || experts->shardable());
}

std::string save_checkpoint(const std::string& root, Config& cfg, const Model& model,
                            const AdamW* opt, const TrainerState& st,
                            const std::string& tokenizer_path, ExpertFiles* experts,
                            Communicator* comm, Communicator* tp) {
  SingleProcess one;
  Communicator& c = comm ? *comm : one;
  const int R = c.size(), me = c.rank();
  // dist.ckpt_layout = sharded: each rank its own pieces (train/checkpoint_sharded.h). The
  // experts must be able to go as pieces (expert parallel; ECSS runs in one process).
  if (saves_sharded(cfg, R * (tp ? tp->size() : 1), experts))
    return save_sharded_checkpoint(root, cfg, model, opt, st, tokenizer_path, experts, c,
                                   tp ? *tp : one);
  // Tensor parallelism: the group assembles the whole tensors, its rank 0 writes them as a
  // tp = 1 run's data rank `me` would (with the other groups' rank 0s), the others wait.
  std::optional<WholeTensors> whole_tensors;
  const bool tp_whole = tp && tp->size() > 1;
  if (tp_whole) {
    whole_tensors = gather_whole_tensors(*tp, me == 0, model, opt);
    // Each expert group comes to the rank writing it, assembled whole over the tp group first.
    if (experts) experts->collect();
    if (tp->rank() != 0) {
      tp->barrier();  // until the checkpoint is committed
      return (std::filesystem::path(root) / checkpoint_name(st.step)).string();
    }
  }
  if (opt && R > 1) {
    if (!whole_tensors) whole_tensors.emplace();
    gather_cut_state(c, model, *opt, *whole_tensors);
  }
  const WholeTensors* whole = whole_tensors ? &*whole_tensors : nullptr;
  const std::string name = checkpoint_name(st.step);
  if (experts && !tp_whole) experts->collect();  // each expert group comes to the rank writing it
  std::optional<CheckpointWriter> w;
  if (me == 0) w.emplace(root, name);
  const std::string tmp = R > 1 ? broadcast_string(c, me == 0 ? w->temp_dir() : "") : w->temp_dir();
  if (me != 0) w.emplace(CheckpointWriter::peer(tmp));
  // Ranks write in waves of dist.ckpt_writers, so that R ranks do not all hit the disk at once.
  const int writers = std::max(1, cfg.dist.ckpt_writers);
  for (int wave = 0; wave * writers < R; ++wave) {
    if (me / writers == wave) {
      if (me == 0) {
        write_rank0_files(*w, cfg, model, opt, st, tokenizer_path, whole);
        if (experts) experts->add_checkpoint_files(*w);
      } else {
        if (opt) {
          std::vector<Tensor> keep;
          w->add_safetensors(optimizer_shard_file(me), optimizer_refs(model, *opt, keep, whole),
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
  if (tp_whole) tp->barrier();  // the group's other ranks go on once it is in place
  return dir;
}

}  // namespace sigma
