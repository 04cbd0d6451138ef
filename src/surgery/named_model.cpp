// Reading and writing checkpoints as named tensors, and parameter counts per group and domain.
#include <fmt/format.h>

#include <cstring>
#include <filesystem>

#include "kernels/ops.h"
#include "model/model.h"
#include "model/names.h"
#include "surgery/surgery.h"
#include "train/checkpoint.h"
#include "train/resume.h"
#include "io/checkpoint_dir.h"
#include "io/file.h"

namespace sigma::surgery {

namespace fs = std::filesystem;

NamedModel read_model(const std::string& path) {
  CheckpointInfo info = open_checkpoint(path);
  NamedModel m;
  m.cfg = info.cfg;
  m.dir = info.dir;
  m.tensors = read_model_tensors(info.dir);  // model.safetensors and any expert group files
  m.tokenizer = checkpoint_tokenizer_path(info.dir);
  m.step = info.state.step;
  m.tokens = info.state.tokens;
  m.origin = info.state.origin;
  m.cfg.model.validate();
  return m;
}

std::string write_model(const std::string& out, NamedModel& m) {
  std::error_code ec;
  const bool existed = fs::exists(out, ec);
  // A killed extract/inherit/domains add left only its temporaries (NAME.tmp-<pid>): not a
  // model, and no reason to refuse the rerun.
  if (existed && fs::is_directory(out, ec)) remove_dead_temporaries(out);
  SIGMA_CHECK(!existed || (fs::is_directory(out, ec) && fs::is_empty(out, ec)),
              "output directory '{}' already exists and is not empty: choose a new --out", out);
  // The config's registry decides which tensors a model has; the result must match it exactly
  // (a mismatch here is a surgery bug, caught before anything is written).
  Model model(m.cfg.model, m.cfg.train.seed);
  for (Param& p : model.params().all()) {
    auto it = m.tensors.find(p.name);
    SIGMA_CHECK(it != m.tensors.end(), "internal: surgery produced no tensor '{}'", p.name);
    SIGMA_CHECK(it->second.dtype() == DType::F32 && it->second.shape() == p.value.shape(),
                "internal: tensor '{}' is {} {} but the config needs F32 {}", p.name,
                dtype_name(it->second.dtype()), shape_str(it->second.shape()),
                shape_str(p.value.shape()));
    ops::upload(p.value, it->second.bytes(), p.value.nbytes());
  }
  for (const Buffer& b : model.buffers().all()) {
    auto it = m.tensors.find(b.name);
    SIGMA_CHECK(it != m.tensors.end(), "internal: surgery produced no routing table '{}'", b.name);
    model.load_buffer(b.name, it->second);
  }
  const size_t expected = model.params().all().size() + model.buffers().all().size();
  SIGMA_CHECK(m.tensors.size() == expected,
              "internal: surgery produced {} tensors but the config needs {}", m.tensors.size(),
              expected);
  // Data and store paths absolute against this directory, as `sigma train` stores them: a
  // later `train --resume OUT` from any directory reads the same shards.
  make_data_paths_absolute(m.cfg);
  make_store_path_absolute(m.cfg);
  // No optimizer file: at step 0 it would be all zeros, which is what resume starts from anyway.
  TrainerState st;
  st.origin = m.origin;
  try {
    return save_checkpoint(out, m.cfg, model, nullptr, st, m.tokenizer);
  } catch (...) {
    // CheckpointWriter removed its temporary directory; drop the root we created.
    if (!existed) fs::remove_all(out, ec);
    throw;
  }
}

nlohmann::json origin_of(const std::string& command, const NamedModel& source,
                         nlohmann::json extra) {
  nlohmann::json o{{"command", command},
                   {"checkpoint", source.dir.empty() ? std::string()
                                                      : fs::absolute(source.dir).lexically_normal().string()},
                   {"step", source.step},
                   {"tokens", source.tokens}};
  o.update(extra);
  if (!source.origin.is_null()) o["origin"] = source.origin;
  return o;
}

Counts count_params(const NamedModel& m) {
  const ModelConfig& c = m.cfg.model;
  Counts n;
  for (const GroupSpec& g : c.groups) {
    GroupCount gc{g.name, g.experts, 0, {}};
    for (const DomainSpec& d : c.domains)
      if (d.group == g.name) gc.domains.push_back(d.name);
    n.groups.push_back(gc);
  }
  int64_t experts = 0;
  for (const auto& [name, t] : m.tensors) {
    if (t.dtype() != DType::F32) continue;  // routing tables are not parameters
    n.total += t.numel();
    const std::string g = names::group_of(name);
    if (g.empty()) continue;
    experts += t.numel();
    n.groups[size_t(c.group_index(g))].params += t.numel();
  }
  n.per_slot = int64_t(c.vocab) * c.d_model;
  n.shared = n.total - experts - n.per_slot * c.slots;
  for (const DomainSpec& d : c.domains) {
    int64_t p = n.shared + n.per_slot;
    if (c.rre_layers > 0) p += n.groups[size_t(c.group_index(d.group))].params;
    n.domains.push_back({d.name, d.group, d.slot, p});
  }
  return n;
}

}  // namespace sigma::surgery
