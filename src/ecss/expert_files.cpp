#include "ecss/expert_files.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "model/names.h"
#include "model/tensor_parallel.h"

namespace sigma {

namespace {

// Step counts in an optimizer file: per-expert "steps" (ECSS) or per-tensor "step" (in-model).
bool is_step(const std::string& n) { return n.ends_with(".steps") || n.ends_with(".step"); }

// The tensor `name` of file `path` (its index) must exist with this dtype and shape.
void check_tensor(const std::map<std::string, TensorInfo>& index, const TensorSource& src,
                  const std::string& name, DType dt, const Shape& shape) {
  const std::string path = src.label();
  auto it = index.find(name);
  SIGMA_CHECK(it != index.end(), "{}: expert tensor '{}' is missing", path, name);
  SIGMA_CHECK(it->second.dtype == dt && it->second.shape == shape,
              "{}: expert tensor '{}' is {} {} but the store expects {} {}", path, name,
              dtype_name(it->second.dtype), shape_str(it->second.shape), dtype_name(dt),
              shape_str(shape));
}

}  // namespace

std::vector<int64_t> check_expert_group(const ExpertGroupSpec& gs, const std::string& name,
                                 const TensorSource& model_path, const TensorSource& opt_path) {
  const Safetensors model_index = model_path.read([](const std::string&) { return false; });
  // A checkpoint without optimizer state (surgery output): the experts start fresh.
  const bool fresh = !opt_path.exists();
  const Safetensors steps_file = fresh ? Safetensors{} : opt_path.read(is_step);
  for (size_t t = 0; t < gs.tensors.size(); ++t) {
    const std::string base = names::expert(gs.block, name, names::kExpertLeaves[t]);
    Shape shape{gs.experts};
    for (int64_t x : gs.tensors[t].shape) shape.push_back(x);
    check_tensor(model_index.index, model_path, base, DType::F32, shape);
    if (fresh) continue;
    check_tensor(steps_file.index, opt_path, base + ".m", DType::F32, shape);
    check_tensor(steps_file.index, opt_path, base + ".v", DType::F32, shape);
  }
  const std::string per_expert = names::expert(gs.block, name, "steps");
  std::vector<int64_t> s;
  if (fresh) {
    s.assign(size_t(gs.experts), 0);
  } else if (steps_file.index.count(per_expert)) {
    check_tensor(steps_file.index, opt_path, per_expert, DType::I64, {gs.experts});
    const int64_t* v = steps_file.tensors.at(per_expert).data<int64_t>();
    s.assign(v, v + gs.experts);
  } else {  // written by an in-model run or by surgery: one step per tensor
    const std::string one = names::expert(gs.block, name, names::kWIn) + ".step";
    check_tensor(steps_file.index, opt_path, one, DType::I64, {});
    s.assign(size_t(gs.experts), *steps_file.tensors.at(one).data<int64_t>());
  }
  for (int64_t x : s)
    SIGMA_CHECK(x >= 0, "{}: negative step count {} in group '{}'", opt_path.label(), x, name);
  return s;
}

void load_expert_group(ExpertStore& store, const ExpertGroupSpec& gs, int32_t first, int32_t count,
                       const std::string& name, const TensorSource& model_path,
                       const TensorSource& opt_path, const std::vector<int64_t>& steps,
                       int tp_size, int tp_rank) {
  SIGMA_CHECK(first >= 0 && count >= 0 && first + count <= gs.experts,
              "experts {}..{} of group '{}' (of {})", first, first + count, name, gs.experts);
  const size_t P = size_t(gs.params());
  std::vector<float> w(P), m(P), v(P);
  const std::string prefix = names::expert_prefix(gs.block, name) + ".";
  // Names under the group's prefix: "w_in" (weights), "w_in.m" / "w_in.v" (moments).
  auto rest = [&](const std::string& n) {
    return n.starts_with(prefix) ? n.substr(prefix.size()) : std::string(".");
  };
  const Safetensors weights = model_path.read([&](const std::string& n) {
    return rest(n).find('.') == std::string::npos;
  });
  const bool fresh = !opt_path.exists();  // no optimizer state: m = v = 0
  const Safetensors moments = fresh ? Safetensors{} : opt_path.read([&](const std::string& n) {
    const std::string r = rest(n);
    return r.find('.') == r.size() - 2 && (r.ends_with(".m") || r.ends_with(".v"));
  });
  // Checked before this group reaches the store (earlier groups may already be there: a failed
  // resume leaves a store that only another resume, which replaces it all, will open).
  for (const auto& [n, t] : weights.tensors) check_finite(t, n, model_path.label());
  for (const auto& [n, t] : moments.tensors) check_finite(t, n, opt_path.label());
  for (int32_t k = first; k < first + count; ++k) {
    for (size_t t = 0; t < gs.tensors.size(); ++t) {
      const std::string base = prefix + names::kExpertLeaves[t];
      const int64_t n = shape_numel(gs.tensors[t].shape), off = gs.offset(t);
      std::memcpy(w.data() + off, weights.tensors.at(base).f() + k * n, size_t(n) * 4);
      if (fresh) continue;
      std::memcpy(m.data() + off, moments.tensors.at(base + ".m").f() + k * n, size_t(n) * 4);
      std::memcpy(v.data() + off, moments.tensors.at(base + ".v").f() + k * n, size_t(n) * 4);
    }
    const ExpertId id{gs.block, gs.group, k - first};
    if (tp_size > 1) {  // this rank's slice of each
      const int64_t d = gs.tensors[0].shape[0], f = gs.tensors[0].shape[1];
      const size_t Pl = size_t(2 * d * (f / tp_size) + f / tp_size + d);
      std::vector<float> wl(Pl), ml(Pl), vl(Pl);
      tp_slice_expert(wl.data(), w.data(), d, f, tp_size, tp_rank);
      tp_slice_expert(ml.data(), m.data(), d, f, tp_size, tp_rank);
      tp_slice_expert(vl.data(), v.data(), d, f, tp_size, tp_rank);
      store.set_weights(id, wl.data());
      store.set_state(id, ml.data(), vl.data(), steps[size_t(k)]);
      continue;
    }
    store.set_weights(id, w.data());
    store.set_state(id, m.data(), v.data(), steps[size_t(k)]);
  }
}


std::string expert_group_file(int32_t block, const std::string& group, bool adam) {
  return fmt::format("experts.{}.{}{}.safetensors", block, group, adam ? ".adam" : "");
}

std::pair<TensorSource, TensorSource> expert_group_paths(const std::string& dir, bool per_group,
                                                         int32_t block, const std::string& group) {
  if (per_group)
    return {TensorSource{.path = dir + "/" + expert_group_file(block, group, false)},
            TensorSource{.path = dir + "/" + expert_group_file(block, group, true)}};
  if (is_sharded_checkpoint(dir))
    return {TensorSource{.sharded_dir = dir, .adam = false}, TensorSource{.sharded_dir = dir, .adam = true}};
  return {TensorSource{.path = dir + "/" + kModelFile}, TensorSource{.path = dir + "/" + kOptimizerFile}};
}

namespace {

// Tensor t of every expert of gs, stacked [K, ...] from per-expert views (no copy).
TensorRef stacked(const std::string& tensor, const ExpertGroupSpec& gs, size_t t,
                  const std::function<const float*(int32_t)>& part_of) {
  TensorRef r{tensor, DType::F32, {gs.experts}, nullptr};
  for (int64_t s : gs.tensors[t].shape) r.shape.push_back(s);
  for (int32_t k = 0; k < gs.experts; ++k) r.parts.push_back(part_of(k) + gs.offset(t));
  return r;
}

}  // namespace

void add_expert_weights_file(CheckpointWriter& w, const ExpertGroupSpec& gs, const std::string& name,
                             const ExpertViews& views) {
  std::vector<TensorRef> refs;
  for (size_t t = 0; t < gs.tensors.size(); ++t)
    refs.push_back(stacked(names::expert(gs.block, name, names::kExpertLeaves[t]), gs, t, views.weights));
  w.add_safetensors(expert_group_file(gs.block, name, false), refs,
                    {{"format", "sigma-experts"}, {"version", "1"}});
}

void add_expert_adam_file(CheckpointWriter& w, const ExpertGroupSpec& gs, const std::string& name,
                          const ExpertViews& views) {
  std::vector<TensorRef> refs;
  std::vector<Tensor> keep;  // step counts, alive until written
  keep.emplace_back(DType::I64, Shape{gs.experts});
  int64_t most = 0;
  for (int32_t k = 0; k < gs.experts; ++k) {
    keep.back().data<int64_t>()[k] = views.step(k);
    most = std::max(most, views.step(k));
  }
  refs.push_back(tensor_ref(names::expert(gs.block, name, "steps"), keep.back()));
  for (size_t t = 0; t < gs.tensors.size(); ++t) {
    const std::string base = names::expert(gs.block, name, names::kExpertLeaves[t]);
    refs.push_back(stacked(base + ".m", gs, t, views.m));
    refs.push_back(stacked(base + ".v", gs, t, views.v));
    keep.emplace_back(DType::I64, Shape{});
    *keep.back().data<int64_t>() = most;
    refs.push_back(tensor_ref(base + ".step", keep.back()));
  }
  w.add_safetensors(expert_group_file(gs.block, name, true), refs,
                    {{"format", "sigma-experts-adam"}, {"version", "1"}});
}

}  // namespace sigma
