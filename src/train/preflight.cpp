#include "train/preflight.h"

#include <fmt/format.h>
#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/refusal.h"

namespace sigma {

int usable_threads(int requested, std::string* note) {
  const int cores = std::max(1, omp_get_num_procs());
  if (requested <= cores) return requested;
  if (note)
    *note = fmt::format("train.threads = {} but this machine lets the process use {} cores; "
                        "using {}", requested, cores, cores);
  return cores;
}

namespace {

// Runs a check, its sigma::Error turned into a Refusal (preflight.h).
template <class F>
auto refusing(F check) {
  try {
    return check();
  } catch (const Refusal&) {
    throw;
  } catch (const Error& e) {
    throw Refusal(e.what());
  }
}

bool power_of_two(int64_t k) { return k > 0 && !(k & (k - 1)); }

// The micro-batch rows for global batch G on R ranks, at most `most` rows each: G = R * 2^k * b
// with the smallest k (the largest micro-batches). 0 when there is none.
int64_t micro_rows(int64_t G, int64_t R, int64_t most) {
  for (int64_t m = R; m <= G; m *= 2)
    if (G % m == 0 && G / m <= most) return G / m;
  return 0;
}

// "a or b": the nearest values below and above `at` (excluded) that `say` accepts; say(v) is
// how v reads in the message, empty when v is not valid.
template <class Say>
std::string nearest(int64_t at, int64_t lo, int64_t hi, Say say) {
  std::vector<std::string> out;
  for (int64_t v = at - 1; v >= lo; --v)
    if (std::string s = say(v); !s.empty()) {
      out.push_back(s);
      break;
    }
  for (int64_t v = at + 1; v <= hi; ++v)
    if (std::string s = say(v); !s.empty()) {
      out.push_back(s);
      break;
    }
  return out.empty() ? "none" : fmt::format("{}", fmt::join(out, " or "));
}

// Whether `ranks` ranks accept a global batch of G rows in micro-batches of train.batch = b
// rows: both checks of resolve_batch, so that every value a refusal suggests is one it accepts
// (before, 10 rows at batch 5 on 4 ranks suggested a global batch of 8, which batch 5 refuses).
bool batch_fits(int64_t G, int64_t b, int64_t ranks) {
  return b > 0 && G > 0 && G % b == 0 && G <= (int64_t(1) << 30) && micro_rows(G, ranks, b) > 0;
}

// A global batch g for R ranks at train.batch = b as a suggestion: "g", or "g (with
// train.batch = b')" when g needs smaller micro-batches than b; empty when R cannot share g.
std::string global_batch_for(int64_t g, int64_t b, int64_t R) {
  if (batch_fits(g, b, R)) return std::to_string(g);
  const int64_t cut = micro_rows(g, R, b);
  return cut > 0 && batch_fits(g, cut, R) ? fmt::format("{} (with train.batch = {})", g, cut) : "";
}

std::string resolve_batch_or_fail(TrainConfig& t, int ranks) {
  const int64_t R = ranks, b = t.batch;
  int64_t G = int64_t(t.batch) * t.accum;
  // R * b rows always fit, so a valid global batch lies within G + R * b.
  auto global_batches = [&] {
    return nearest(G, 1, G + R * b, [&](int64_t g) { return global_batch_for(g, b, R); });
  };
  if (t.global_batch > 0) {  // train.accum follows from it (a resumed run's saved one too)
    G = t.global_batch;
    const std::string batches = nearest(b, 1, G, [&](int64_t v) {
      return batch_fits(G, v, R) ? std::to_string(v) : "";
    });
    SIGMA_CHECK(G % b == 0, "train.global_batch = {} rows cannot be cut into micro-batches of "
                "train.batch = {} rows; nearest valid on {} ranks: {}train.global_batch = {}", G, b,
                R, batches == "none" ? "" : "train.batch = " + batches + ", or ", global_batches());
  }
  SIGMA_CHECK(G <= (int64_t(1) << 30), "the global batch of {} rows is more than 2^30", G);
  t.global_batch = int(G);
  const int64_t M = G / b;
  if (M % R == 0 && (R == 1 || power_of_two(M / R))) {
    t.accum = int(M);
    return "";
  }
  const int64_t cut = micro_rows(G, R, b);
  if (cut == 0)
    fail("{} ranks cannot share a global batch of {} rows (train.global_batch, or train.batch x "
         "train.accum = {} x {}): each rank runs an equal power-of-two number of equal "
         "micro-batches of at most train.batch = {} rows, which keeps every rank count "
         "bit-identical; nearest valid: train.global_batch = {}, or mpirun -np {}", R, G, t.batch,
         t.accum, b, global_batches(),
         nearest(R, 1, G, [&](int64_t r) { return batch_fits(G, b, r) ? std::to_string(r) : ""; }));
  const std::string note = fmt::format(
      "{} ranks share the global batch of {} rows as {} micro-batches of {} rows ({} per rank; "
      "train.batch = {} would make {}, which {} ranks cannot share in equal power-of-two blocks); "
      "the result is bit-identical to any rank count run with train.batch = {}",
      R, G, G / cut, cut, G / cut / R, b, M, R, cut);
  t.batch = int(cut);
  t.accum = int(G / cut);
  return note;
}

}  // namespace

std::string resolve_batch(TrainConfig& t, int ranks) {
  return refusing([&] { return resolve_batch_or_fail(t, ranks); });
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

int64_t dense_training_bytes(const Config& cfg) {
  const ModelConfig& m = cfg.model;
  const ParamCount p = count_params(m);
  // Activations kept for backward: per block and token about 16 d-wide rows (LayerNorms,
  // Q/K/V, attention output, residuals) and two f-wide rows (FFN in and its activation), the
  // T x T attention weights per head, and the logits with their gradient.
  const int64_t BT = int64_t(cfg.train.batch) * m.context;
  const int64_t acts = BT * m.layers * (16 * int64_t(m.d_model) + 2 * int64_t(m.ffn()) +
                                        int64_t(m.heads) * m.context) +
                       2 * BT * int64_t(m.vocab);
  // With accumulation the step's gradient sum tree keeps up to log2(accum) + 1 partial sums.
  int64_t partials = 0;
  if (cfg.train.accum > 1)
    for (int64_t k = cfg.train.accum; k > 0; k >>= 1) ++partials;
  return (p.total - p.experts) * (16 + 4 * partials) + acts * 4;
}

int64_t training_bytes(const Config& cfg) {
  const bool file_store = !cfg.train.expert_store.empty() && cfg.train.experts != "model";
  return dense_training_bytes(cfg) + (file_store ? 0 : count_params(cfg.model).experts * 16);
}

namespace {
int64_t physical_memory() {
  return int64_t(::sysconf(_SC_PHYS_PAGES)) * int64_t(::sysconf(_SC_PAGESIZE));
}
}  // namespace

int64_t expert_memory_bytes(const TrainConfig& t) {
  const std::string& s = t.expert_memory;
  if (s == "auto") return std::max<int64_t>(physical_memory() / 4, int64_t(1) << 28);
  static const std::pair<const char*, double> units[] = {
      {"TiB", 0x1p40}, {"GiB", 0x1p30}, {"MiB", 0x1p20}, {"KiB", 0x1p10},
      {"TB", 1e12},    {"GB", 1e9},     {"MB", 1e6},     {"KB", 1e3},     {"B", 1}, {"", 1}};
  size_t used = 0;
  double number = -1;
  try {
    number = std::stod(s, &used);
  } catch (const std::exception&) {
  }
  const std::string unit = used ? s.substr(used) : s;
  for (const auto& [name, scale] : units)
    if (used && unit == name && number > 0 && number * scale < 0x1p62) return int64_t(number * scale);
  fail("train.expert_memory = '{}': expected auto or a positive size such as 6GiB, 512MiB, 2GB "
       "or a number of bytes", s);
}

static void refuse_options(const Config& cfg, const std::string& experts, int ranks, bool out_dir) {
  expert_memory_bytes(cfg.train);  // a bad size is refused even where it would not be used
  Config def;
  const nlohmann::json now = Config(cfg).to_json(), was = def.to_json();
  // The option `key` ("train.expert_store"), when set away from its default, needs `needs`.
  auto refuse = [&](const char* key, bool applies, const std::string& why) {
    const std::string section(key, std::string_view(key).find('.')), field(key + section.size() + 1);
    const nlohmann::json& v = now[section][field];
    SIGMA_CHECK(applies || v == was[section][field], "{} = {} does not apply to this run: {}", key,
                v.is_string() ? v.get<std::string>() : v.dump(), why);
  };
  const bool store = experts == "ecss" || experts == "vanilla";
  const std::string mode = cfg.train.experts == experts
                               ? fmt::format("train.experts = {}", experts)
                               : fmt::format("train.experts = {} (here: {})", cfg.train.experts, experts);
  refuse("train.expert_store", experts != "model",
         fmt::format("there is no expert store, the experts train in the model ({})", mode));
  refuse("train.expert_memory", store,
         fmt::format("it sizes the ECSS compute buffers, and this run has {}", mode));
  const bool sparse = cfg.model.rre_layers > 0, gated = sparse && cfg.model.gated();
  for (const char* key : {"model.router", "model.routing", "model.routing_seed", "optim.eps_rre"})
    refuse(key, sparse, "the model is dense (model.rre_layers = 0), it has no expert blocks");
  for (const char* key : {"model.capacity_factor", "model.aux_loss_weight"})
    refuse(key, gated, fmt::format("it belongs to the learned gate, and this model has model.router "
           "= {}{}", cfg.model.router, sparse ? "" : " and no expert blocks"));
  refuse("model.routing", !gated, fmt::format("routing tables are not used by the learned gate "
         "(model.router = {})", cfg.model.router));
  const bool synthetic = cfg.data.source == "synthetic";
  for (const char* key : {"data.path", "data.tokenizer", "data.finetune"})
    refuse(key, !synthetic, "it reads prepared shards, and this run has data.source = synthetic");
  refuse("data.mask_prompt", cfg.data.finetune && !synthetic, "it masks the prompts of fine-tuning "
         "rows, and this run packs windows (data.finetune = false) or uses the synthetic data");
  for (const char* key : {"train.ckpt_every", "train.keep_checkpoints", "train.keep_every"})
    refuse(key, out_dir, "this run writes no checkpoints (no output directory, --out)");
  refuse("train.keep_every", cfg.train.keep_checkpoints > 0, "it spares checkpoints from the "
         "pruning that train.keep_checkpoints sets, and train.keep_checkpoints = 0 keeps them all");
  refuse("dist.overlap_mib", cfg.dist.overlap, "it bounds the exchanges that dist.overlap keeps in "
         "flight, and this run has dist.overlap = false");
  // Otherwise dist.* is not refused on one process: the rank count belongs to the launch, not to the
  // config, and a run (or a checkpoint's config) must resume at any rank count (docs/distributed.md).
  (void)ranks;
}

static void memory_fits(const Config& cfg) {
  const int64_t need = training_bytes(cfg);
  const int64_t have = physical_memory();
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

static void tensor_parallel_fits(const Config& cfg, int world, const std::string& experts) {
  const int tp = cfg.dist.tp;
  if (tp == 1) return;
  SIGMA_CHECK(world % tp == 0, "dist.tp = {} does not divide the {} ranks of this run: the ranks "
              "form groups of dist.tp adjacent ranks (use a dist.tp that divides {}, or mpirun -np "
              "a multiple of {})", tp, world, world, tp);
  SIGMA_CHECK(cfg.model.heads % tp == 0, "dist.tp = {} does not divide model.heads = {}: each "
              "tensor-parallel rank computes whole heads (use a dist.tp that divides {})", tp,
              cfg.model.heads, cfg.model.heads);
  // The model checks this too, but only after rank 0 has locked --out (a refused run left
  // OUT/.lock behind); model.vocab = 0 takes the data's vocabulary, known only later.
  SIGMA_CHECK(cfg.model.vocab <= 0 || cfg.model.vocab % tp == 0, "dist.tp = {} does not divide "
              "model.vocab = {}: each tensor-parallel rank holds an equal share of the vocabulary "
              "(the embedding, the tied head and the loss are vocabulary-parallel); set model.vocab "
              "= {} (ids the data never uses are never a target and only learn to be unlikely)", tp,
              cfg.model.vocab, (cfg.model.vocab + tp - 1) / tp * tp);
  SIGMA_CHECK(experts != "ecss" && experts != "vanilla", "dist.tp = {} with train.experts = {}: "
              "the experts' store belongs to one process; use train.experts = model or parallel",
              tp, experts);
  SIGMA_CHECK(!cfg.optim.sparse_embeddings, "dist.tp = {} with optim.sparse_embeddings = true: "
              "not built yet (the lazy per-row Adam steps of a vocabulary-parallel embedding are "
              "not split and assembled in checkpoints); use optim.sparse_embeddings = false", tp);
}

std::vector<std::string> hosts_of_ranks(Communicator& world) {
  constexpr size_t kName = 256;  // HOST_NAME_MAX is 64 on Linux
  char mine[kName] = {};
  ::gethostname(mine, kName - 1);
  std::vector<char> all(kName * size_t(world.size()));
  world.all_gather_bytes(all.data(), mine, kName);
  std::vector<std::string> hosts;
  for (int r = 0; r < world.size(); ++r) hosts.emplace_back(all.data() + size_t(r) * kName);
  return hosts;
}

namespace {
// "0-1" or "4": a run of ranks [a, b].
std::string rank_range(int a, int b) {
  return a == b ? std::to_string(a) : fmt::format("{}-{}", a, b);
}

// Whether every group of tp adjacent ranks lies on one host.
bool tp_fits_hosts(const std::vector<std::string>& host, int tp) {
  if (tp < 1 || host.size() % size_t(tp) != 0) return false;
  for (size_t r = 0; r < host.size(); ++r)
    if (host[r] != host[r - r % size_t(tp)]) return false;
  return true;
}
}  // namespace

namespace {
// "h0: ranks 0-1; h1: ranks 2-3" for ranks [from, to) of `host`, hosts in order of first rank.
std::string describe_hosts(const std::vector<std::string>& host, size_t from, size_t to) {
  std::vector<std::string> order;
  std::vector<std::vector<std::string>> runs;  // per host in `order`: its runs of ranks
  for (size_t r = from, end; r < to; r = end + 1) {
    for (end = r; end + 1 < to && host[end + 1] == host[r];) ++end;
    const size_t h = size_t(std::find(order.begin(), order.end(), host[r]) - order.begin());
    if (h == order.size()) order.push_back(host[r]), runs.emplace_back();
    runs[h].push_back(rank_range(int(r), int(end)));
  }
  std::vector<std::string> out;
  for (size_t h = 0; h < order.size(); ++h)
    out.push_back(fmt::format("{}: ranks {}", order[h], fmt::join(runs[h], ", ")));
  return fmt::format("{}", fmt::join(out, "; "));
}
}  // namespace

std::string describe_hosts(const std::vector<std::string>& host) {
  return describe_hosts(host, 0, host.size());
}

void check_tp_within_hosts(const std::vector<std::string>& host, int tp) {
  refusing([&] {
    // A tp that does not divide the ranks is check_tensor_parallel's refusal.
    if (tp <= 1 || host.size() % size_t(tp) != 0 || tp_fits_hosts(host, tp)) return;
    size_t g = 0;  // the first group that crosses hosts
    while (std::all_of(host.begin() + long(g), host.begin() + long(g) + tp,
                       [&](const std::string& h) { return h == host[g]; }))
      g += size_t(tp);
    std::vector<std::string> fit;
    for (int t = tp - 1; t >= 1; --t)
      if (tp_fits_hosts(host, t)) fit.push_back(std::to_string(t));
    fail("dist.tp = {} puts tp group {} (ranks {}) on more than one host ({}): a tp group "
         "exchanges its activations twice per block and pass and must stay inside a host; use "
         "dist.tp = {}, or give every host a multiple of {} ranks, in rank order (a hostfile with "
         "slots = a multiple of {} and mpirun --map-by slot)", tp, g / size_t(tp),
         rank_range(int(g), int(g) + tp - 1), describe_hosts(host, g, g + size_t(tp)),
         fmt::join(fit, " or "), tp, tp);
  });
}

// The checks every rank makes alike throw Refusal: printed once (preflight.h).
void refuse_inapplicable_options(const Config& cfg, const std::string& experts, int ranks,
                                 bool out_dir) {
  refusing([&] { refuse_options(cfg, experts, ranks, out_dir); });
}

void check_memory(const Config& cfg) {
  refusing([&] { memory_fits(cfg); });
}

void check_tensor_parallel(const Config& cfg, int world, const std::string& experts) {
  refusing([&] { tensor_parallel_fits(cfg, world, experts); });
}

}  // namespace sigma
