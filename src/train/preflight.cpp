#include "train/preflight.h"

#include <omp.h>
#include <unistd.h>

#include <fmt/format.h>

#include "core/error.h"

namespace sigma {

int usable_threads(int requested, std::string* note) {
  const int cores = std::max(1, omp_get_num_procs());
  if (requested <= cores) return requested;
  if (note)
    *note = fmt::format("train.threads = {} but this machine lets the process use {} cores; "
                        "using {}", requested, cores, cores);
  return cores;
}

ParamCount count_params(const ModelConfig& m) {
  const int64_t V = m.vocab, d = m.d_model, f = m.ffn(), T = m.context, L = m.layers;
  const int64_t ffn = d * f + f + f * d + d;                 // w_in, b_in, w_out, b_out
  const int64_t block = 2 * d + 3 * d * d + 3 * d + d * d + d + 2 * d;  // ln1, qkv, out, ln2
  ParamCount c;
  c.total = int64_t(m.slots) * V * d + T * d + L * block + T * d /* query table */ + 2 * d;
  for (int l = 0; l < L; ++l) {
    if (!m.is_rre_block(l)) {
      c.total += ffn;
      continue;
    }
    for (const GroupSpec& g : m.groups) {
      c.experts += g.experts * ffn;
      if (m.gated()) c.total += d * g.experts;
    }
  }
  c.total += c.experts;
  return c;
}

int64_t training_bytes(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  const ParamCount p = count_params(m);
  const bool file_store = !cfg.train.expert_store.empty() && cfg.train.experts != "model";
  const int64_t resident = file_store ? p.total - p.experts : p.total;
  // Activations kept for backward: per block and token about 16 d-wide rows (LayerNorms,
  // Q/K/V, attention output, residuals) and two f-wide rows (FFN in and its activation), the
  // T x T attention weights per head, and the logits with their gradient.
  const int64_t BT = int64_t(cfg.train.batch) * m.context;
  const int64_t acts = BT * m.layers * (16 * int64_t(m.d_model) + 2 * int64_t(m.ffn()) +
                                        int64_t(m.heads) * m.context) +
                       2 * BT * int64_t(m.vocab);
  return resident * 16 + acts * 4;
}

void check_memory(const Config& cfg) {
  const int64_t need = training_bytes(cfg);
  const int64_t have = int64_t(::sysconf(_SC_PHYS_PAGES)) * int64_t(::sysconf(_SC_PAGESIZE));
  const ParamCount p = count_params(cfg.model);
  auto gib = [](int64_t b) { return double(b) / double(int64_t(1) << 30); };
  SIGMA_CHECK(have <= 0 || need <= have,
              "this config needs about {:.1f} GiB of memory ({} parameters, {} of them in experts, "
              "at 16 bytes each with gradients and Adam moments, plus activations of {} rows of "
              "{} tokens) but this machine has {:.1f} GiB; make the model or train.batch smaller{}",
              gib(need), p.total, p.experts, cfg.train.batch, cfg.model.context, gib(have),
              p.experts > 0 && cfg.train.expert_store.empty()
                  ? ", or keep the experts in a file (--expert-store PATH)"
                  : "");
}

}  // namespace sigma
