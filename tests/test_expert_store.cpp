// The ECSS expert store (src/ecss/expert_store.h): lazy sparse Adam against a dense reference,
// untouched experts bit for bit, RAM and file backings bit-identical, reopening, checkpoint
// views, and bad store files.
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/bf16.h"
#include "core/rng.h"
#include "ecss/expert_store.h"
#include "ecss/gradient_area.h"
#include "io/safetensors.h"

#include "cli_util.h"
#include "device_access.h"

using namespace sigma;
namespace fs = std::filesystem;

namespace {

using sigma::testing::TempDir;

// Three groups of RRE experts (d=4, f=6: P = 58, not a multiple of 16) and one smaller group.
ExpertStoreSpec small_spec() {
  ExpertStoreSpec s;
  s.groups = {rre_group_spec(0, 0, 5, 4, 6), rre_group_spec(0, 1, 5, 4, 6),
              rre_group_spec(1, 0, 5, 4, 6), rre_group_spec(1, 1, 3, 3, 5)};
  return s;
}

std::vector<ExpertId> all_ids(const ExpertStoreSpec& s) {
  std::vector<ExpertId> ids;
  for (const auto& g : s.groups)
    for (int32_t e = 0; e < g.experts; ++e) ids.push_back({g.block, g.group, e});
  return ids;
}


void init_weights(ExpertStore& st) {
  const auto ids = all_ids(st.spec());
  for (size_t k = 0; k < ids.size(); ++k) {
    std::vector<float> w(static_cast<size_t>(st.params(ids[k])));
    for (size_t i = 0; i < w.size(); ++i) w[i] = 0.5f * rng_normal(11, k, i);
    st.set_weights(ids[k], w.data());
  }
}

// Training step t (1-based) of the test sequence: which experts are active, their gradients,
// the hyperparameters. Step 3 sends bf16 gradients.
bool active(int t, size_t k) { return rng_u64(5, uint64_t(t), k) % 5 < 2 || (t == 1 && k == 0); }
std::vector<float> grads(int t, size_t k, int64_t p) {
  std::vector<float> g(static_cast<size_t>(p));
  for (int64_t i = 0; i < p; ++i) g[size_t(i)] = 0.1f * rng_normal(17, uint64_t(t) * 1000 + k, i);
  if (t == 3)
    for (float& x : g) x = from_bf16(to_bf16(x));
  return g;
}
AdamStepArgs hyper(int t) {
  AdamStepArgs a;
  a.lr = 1e-3f * (1.0f + 0.1f * float(t));
  a.eps = 1e-10f;  // eps_rre
  a.weight_decay = 0.1f;
  a.grad_scale = t == 2 ? 0.5f : 1.0f;
  a.step = 999;  // ignored by the store
  return a;
}

void run_step(ExpertStore& st, int t) {
  const auto ids = all_ids(st.spec());
  for (size_t k = 0; k < ids.size(); ++k) {
    if (!active(t, k)) continue;
    std::vector<float> g = grads(t, k, st.params(ids[k]));
    if (t == 3) {
      std::vector<uint16_t> gb(g.size());
      for (size_t i = 0; i < g.size(); ++i) gb[i] = to_bf16(g[i]);
      st.apply_grads(ids[k], gb.data(), hyper(t));
    } else {
      st.apply_grads(ids[k], g.data(), hyper(t));
    }
  }
}

// A whole record's bytes (weights, m, v over P each, and the step), for bit comparisons.
std::vector<uint8_t> snapshot(const ExpertStore& st, ExpertId id) {
  const size_t p = size_t(st.params(id)) * 4;
  std::vector<uint8_t> b(3 * p + 8);
  std::memcpy(b.data(), st.weights(id), p);
  std::memcpy(b.data() + p, st.m(id), p);
  std::memcpy(b.data() + 2 * p, st.v(id), p);
  const int64_t s = st.step(id);
  std::memcpy(b.data() + 3 * p, &s, 8);
  return b;
}

bool same_bits(const ExpertStore& a, const ExpertStore& b) {
  for (ExpertId id : all_ids(a.spec()))
    if (snapshot(a, id) != snapshot(b, id)) return false;
  return true;
}

// Dense lazy Adam in double: every expert's state is a plain array; an expert's moments and
// step advance only on steps where it is active.
struct Reference {
  struct Expert {
    std::vector<double> w, m, v, mabs;  // mabs: sum of |terms| of m, to bound cancellation
    int64_t step = 0;
  };
  std::vector<Expert> experts;
  ExpertStoreSpec spec;

  explicit Reference(const ExpertStore& st) : spec(st.spec()) {
    for (ExpertId id : all_ids(spec)) {
      const int64_t p = st.params(id);
      Expert e;
      e.w.assign(st.weights(id), st.weights(id) + p);
      e.m.assign(size_t(p), 0.0), e.v.assign(size_t(p), 0.0), e.mabs.assign(size_t(p), 0.0);
      experts.push_back(std::move(e));
    }
  }
  void step(int t) {
    const auto ids = all_ids(spec);
    const AdamStepArgs a = hyper(t);
    for (size_t k = 0; k < ids.size(); ++k) {
      if (!active(t, k)) continue;
      Expert& e = experts[k];
      const ExpertGroupSpec* g = nullptr;
      for (const auto& gg : spec.groups)
        if (gg.block == ids[k].block && gg.group == ids[k].group) g = &gg;
      const std::vector<float> grad = grads(t, k, g->params());
      e.step += 1;
      const double bc1 = 1.0 - std::pow(double(a.beta1), double(e.step));
      const double bc2 = 1.0 - std::pow(double(a.beta2), double(e.step));
      int64_t off = 0;
      for (const auto& ts : g->tensors) {
        const double wd = ts.decay ? a.weight_decay : 0.0;
        for (int64_t i = off; i < off + shape_numel(ts.shape); ++i) {
          const double gi = double(grad[size_t(i)]) * a.grad_scale;
          e.m[i] = a.beta1 * e.m[i] + (1.0 - a.beta1) * gi;
          e.mabs[i] = a.beta1 * e.mabs[i] + (1.0 - a.beta1) * std::fabs(gi);
          e.v[i] = a.beta2 * e.v[i] + (1.0 - a.beta2) * gi * gi;
          const double den = std::sqrt(e.v[i] / bc2) + a.eps;
          e.w[i] -= a.lr * wd * e.w[i] + a.lr * (e.m[i] / bc1) / den;
        }
        off += shape_numel(ts.shape);
      }
    }
  }
  // Element by element. fp32 rounds each stored value by ~6e-8 relative per operation; the
  // bounds below allow 1e-6 relative (and 1e-4 of one step's size on w, where the fp32 and
  // double divisions differ), far below what a wrong step count, bias correction or weight
  // decay changes (>= 1e-4 relative per step).
  int64_t mismatches(const ExpertStore& st) const {
    int64_t bad = 0;
    const auto ids = all_ids(spec);
    for (size_t k = 0; k < ids.size(); ++k) {
      const Expert& e = experts[k];
      EXPECT_EQ(st.step(ids[k]), e.step) << "expert " << k;
      const float *w = st.weights(ids[k]), *m = st.m(ids[k]), *v = st.v(ids[k]);
      for (size_t i = 0; i < e.w.size(); ++i) {
        const double tol_w = 1e-6 * std::fabs(e.w[i]) + 1e-4 * 2e-3 * double(e.step) + 1e-30;
        const double tol_m = 1e-6 * e.mabs[i] + 1e-30, tol_v = 1e-6 * e.v[i] + 1e-30;
        if (std::fabs(w[i] - e.w[i]) > tol_w || std::fabs(m[i] - e.m[i]) > tol_m ||
            std::fabs(v[i] - e.v[i]) > tol_v) {
          if (++bad <= 5)
            ADD_FAILURE() << "expert " << k << " elem " << i << ": w " << w[i] << " vs " << e.w[i]
                          << ", m " << m[i] << " vs " << e.m[i] << ", v " << v[i] << " vs "
                          << e.v[i];
        }
      }
    }
    return bad;
  }
};

ExpertStore make_store(bool file, const TempDir& dir, const std::string& name = "experts.store") {
  return file ? ExpertStore::open(dir / name, small_spec()) : ExpertStore::in_ram(small_spec());
}

// ---- spec ------------------------------------------------------------------------------------

TEST(ExpertStoreSpec, ValidatesAndHashesEveryField) {
  ExpertStoreSpec s = small_spec();
  EXPECT_NO_THROW(s.validate());
  EXPECT_EQ(s.groups[0].params(), 4 * 6 + 6 + 6 * 4 + 4);
  EXPECT_EQ(s.groups[0].offset(2), 4 * 6 + 6);
  EXPECT_EQ(s.groups[1].prefix(), "blocks.0.rre.1");
  const uint64_t h = s.hash();
  auto changed = [&](auto edit) {
    ExpertStoreSpec t = small_spec();
    edit(t);
    return t.hash() != h;
  };
  EXPECT_TRUE(changed([](ExpertStoreSpec& t) { t.groups[0].experts = 6; }));
  EXPECT_TRUE(changed([](ExpertStoreSpec& t) { t.groups[3].tensors[0].shape = {5, 3}; }));
  EXPECT_TRUE(changed([](ExpertStoreSpec& t) { t.groups[2].tensors[1].decay = true; }));
  EXPECT_TRUE(changed([](ExpertStoreSpec& t) { t.groups[1].block = 7; }));
  ExpertStoreSpec dup = small_spec();
  dup.groups[1].group = 0;
  EXPECT_THROW(dup.validate(), Error);
  ExpertStoreSpec empty = small_spec();
  empty.groups[0].experts = 0;
  EXPECT_THROW(ExpertStore::in_ram(empty), Error);
  ExpertStoreSpec zero_dim = small_spec();
  zero_dim.groups[0].tensors[0].shape = {4, 0};
  EXPECT_THROW(zero_dim.validate(), Error);
}

TEST(ExpertStore, UnknownExpertIsAnError) {
  ExpertStore st = ExpertStore::in_ram(small_spec());
  EXPECT_THROW(st.step({1, 1, 3}), Error);  // group (1, 1) has 3 experts
  EXPECT_THROW(st.step({2, 0, 0}), Error);
  EXPECT_THROW(st.step({0, 0, -1}), Error);
  EXPECT_EQ(st.step({1, 1, 2}), 0);
  EXPECT_EQ(st.num_experts(), 18);
}

// ---- lazy sparse Adam ------------------------------------------------------------------------

class Backing : public ::testing::TestWithParam<bool> {};  // true: file-backed

TEST_P(Backing, SparseUpdateMatchesDenseLazyReferenceAndLeavesOthersBitIdentical) {
  TempDir dir;
  ExpertStore st = make_store(GetParam(), dir);
  init_weights(st);
  Reference ref(st);
  const auto ids = all_ids(st.spec());
  for (int t = 1; t <= 6; ++t) {
    std::vector<std::vector<uint8_t>> before;
    for (ExpertId id : ids) before.push_back(snapshot(st, id));
    run_step(st, t);
    ref.step(t);
    for (size_t k = 0; k < ids.size(); ++k) {
      if (active(t, k))
        EXPECT_NE(snapshot(st, ids[k]), before[k]) << "active expert " << k << " at step " << t;
      else
        EXPECT_EQ(snapshot(st, ids[k]), before[k]) << "inactive expert " << k << " changed at step " << t;
    }
    EXPECT_EQ(ref.mismatches(st), 0) << "step " << t;
  }
  // The sequence exercises laziness: some expert skipped steps, so its step count lags.
  int64_t min_step = 99, max_step = 0;
  for (ExpertId id : ids) min_step = std::min(min_step, st.step(id)), max_step = std::max(max_step, st.step(id));
  EXPECT_LT(min_step, max_step);
  EXPECT_GE(min_step, 0);
}

TEST_P(Backing, GatherCopiesTheWeights) {
  TempDir dir;
  ExpertStore st = make_store(GetParam(), dir);
  init_weights(st);
  const std::vector<ExpertId> ids = {{1, 1, 2}, {0, 0, 0}, {1, 0, 4}};
  std::vector<Tensor> out;  // device memory: gather uploads to its destinations
  std::vector<float*> dst;
  for (ExpertId id : ids) out.push_back(ops::empty(DType::F32, {st.params(id)}));
  for (auto& o : out) dst.push_back(o.dev_f());
  st.prefetch(ids);
  st.gather(ids, dst);
  for (size_t i = 0; i < ids.size(); ++i)
    EXPECT_EQ(0, std::memcmp(sigma::testing::host_floats(out[i]).data(), st.weights(ids[i]),
                             size_t(out[i].numel()) * 4));
  EXPECT_THROW(st.gather(ids, std::span<float* const>(dst.data(), 2)), Error);
}

TEST_P(Backing, BatchedUpdateGivesTheSameBitsAsOneByOne) {
  TempDir dir;
  ExpertStore a = make_store(GetParam(), dir, "a.store"), b = make_store(GetParam(), dir, "b.store");
  init_weights(a), init_weights(b);
  const auto ids = all_ids(a.spec());
  std::vector<ExpertId> active_ids;
  std::vector<std::vector<float>> g;
  std::vector<const float*> gp;
  for (size_t k = 0; k < ids.size(); k += 2) {
    active_ids.push_back(ids[k]);
    g.push_back(grads(1, k, a.params(ids[k])));
  }
  for (auto& x : g) gp.push_back(x.data());
  for (int t = 1; t <= 2; ++t) {
    a.apply_grads(active_ids, gp, hyper(t));
    for (size_t i = 0; i < active_ids.size(); ++i) b.apply_grads(active_ids[i], gp[i], hyper(t));
  }
  EXPECT_TRUE(same_bits(a, b));
  EXPECT_EQ(a.step(ids[0]), 2);
  EXPECT_EQ(a.step(ids[1]), 0);
  std::vector<ExpertId> dup = {ids[0], ids[0]};
  std::vector<const float*> dup_g = {gp[0], gp[0]};
  EXPECT_THROW(a.apply_grads(dup, dup_g, hyper(3)), Error);
  EXPECT_EQ(a.step(ids[0]), 2);  // refused before any update
}

INSTANTIATE_TEST_SUITE_P(RamAndFile, Backing, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "File" : "Ram"; });

TEST(ExpertStoreBackings, RamAndFileAreBitIdenticalAndFileSurvivesReopen) {
  TempDir dir;
  const std::string path = dir / "e.store";
  ExpertStore ram = ExpertStore::in_ram(small_spec());
  init_weights(ram);
  {
    ExpertStore file = ExpertStore::open(path, small_spec());
    EXPECT_TRUE(file.created());
    EXPECT_TRUE(file.file_backed());
    init_weights(file);
    for (int t = 1; t <= 3; ++t) {
      run_step(ram, t);
      run_step(file, t);
      EXPECT_TRUE(same_bits(ram, file)) << "step " << t;
    }
    file.flush();
  }  // closed
  ExpertStore file = ExpertStore::open(path, small_spec());
  EXPECT_FALSE(file.created());
  EXPECT_TRUE(file.clean_on_open());
  EXPECT_TRUE(same_bits(ram, file));
  for (int t = 4; t <= 6; ++t) {
    run_step(ram, t);
    run_step(file, t);
  }
  EXPECT_TRUE(same_bits(ram, file));
}

TEST(ExpertStoreBackings, ClosingWithoutFlushStillFlushes) {
  TempDir dir;
  const std::string path = dir / "e.store";
  ExpertStore ram = ExpertStore::in_ram(small_spec());
  init_weights(ram);
  run_step(ram, 1);
  {
    ExpertStore file = ExpertStore::open(path, small_spec());
    init_weights(file);
    run_step(file, 1);
  }
  ExpertStore file = ExpertStore::open(path, small_spec());
  EXPECT_TRUE(file.clean_on_open());
  EXPECT_TRUE(same_bits(ram, file));
}

// A process that dies between two flushes leaves the header marked unclean; the next open says
// so (the trainer then restores the records from its checkpoint).
TEST(ExpertStoreBackings, CrashBetweenFlushesIsReportedOnOpen) {
  TempDir dir;
  const std::string path = dir / "e.store";
  {
    ExpertStore file = ExpertStore::open(path, small_spec());
    init_weights(file);
  }
  const ExpertStoreSpec spec = small_spec();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {  // child: update one small expert (no OpenMP region) and die without flushing
    int code = 1;
    try {
      ExpertStore file = ExpertStore::open(path, spec);
      std::vector<float> g(size_t(file.params({1, 1, 0})), 0.5f);
      file.apply_grads({1, 1, 0}, g.data(), hyper(1));
      code = 0;
      ::_exit(code);
    } catch (...) {
    }
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  ExpertStore file = ExpertStore::open(path, small_spec());
  EXPECT_FALSE(file.clean_on_open());
  EXPECT_EQ(file.step({1, 1, 0}), 1);  // the child's update is in the file, unflushed
}

// ---- checkpoint views ------------------------------------------------------------------------

TEST(ExpertStoreCheckpoint, ViewsPointIntoTheStoreAndRoundTripThroughSafetensors) {
  TempDir dir;
  ExpertStore file = ExpertStore::open(dir / "e.store", small_spec());
  init_weights(file);
  for (int t = 1; t <= 4; ++t) run_step(file, t);
  const std::vector<TensorRef> refs = file.tensor_refs();
  EXPECT_EQ(refs.size(), size_t(file.num_experts()) * (3 * 4 + 1));
  // No copies: every view lies inside the expert's record.
  for (const TensorRef& r : refs) {
    if (r.name == "blocks.1.rre.0.experts.4.w_out.v") {
      const ExpertId id{1, 0, 4};
      EXPECT_EQ(r.data, file.v(id) + file.spec().groups[2].offset(2));
    }
    if (r.name == "blocks.0.rre.1.experts.2.step") {
      EXPECT_EQ(r.data, static_cast<const void*>(file.weights({0, 1, 2}) - 16));  // record head
      EXPECT_EQ(*static_cast<const int64_t*>(r.data), file.step({0, 1, 2}));
    }
  }
  const std::string ck = dir / "experts.safetensors";
  write_safetensors(ck, refs, {{"format", "sigma-ecss"}});
  Safetensors loaded = read_safetensors(ck);
  ExpertStore ram = ExpertStore::in_ram(small_spec());
  ram.import_tensors(loaded.tensors, ck);
  EXPECT_TRUE(same_bits(ram, file));
  // Training continues identically from the imported state.
  run_step(ram, 5), run_step(file, 5);
  EXPECT_TRUE(same_bits(ram, file));

  TensorMap missing = std::move(loaded.tensors);
  missing.erase("blocks.1.rre.1.experts.2.b_out.m");
  ExpertStore other = ExpertStore::in_ram(small_spec());
  try {
    other.import_tensors(missing, ck);
    ADD_FAILURE() << "import of an incomplete map succeeded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("blocks.1.rre.1.experts.2.b_out.m"), std::string::npos);
  }
  missing["blocks.1.rre.1.experts.2.b_out.m"] = Tensor::f32({4});
  EXPECT_THROW(other.import_tensors(missing, ck), Error);  // shape [4] but the store has [3]
  EXPECT_EQ(other.step({0, 0, 0}), 0);                     // nothing copied on failure
}

// ---- bad files -------------------------------------------------------------------------------

// Expects open(path) to throw a sigma::Error whose message names `path` and contains `what`.
void expect_open_error(const std::string& path, const ExpertStoreSpec& spec, const std::string& what) {
  try {
    ExpertStore::open(path, spec);
    ADD_FAILURE() << "opening " << path << " succeeded; expected an error about " << what;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(what), std::string::npos) << msg;
  }
}

std::string read_all(const std::string& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

TEST(ExpertStoreBadFiles, WrongSizeVersionSpecOrContentAreClearErrorsAndTouchNothing) {
  TempDir dir;
  const std::string good = dir / "good.store";
  {
    ExpertStore st = ExpertStore::open(good, small_spec());
    init_weights(st);
  }
  auto variant = [&](const std::string& name, auto edit) {
    const std::string p = dir / name;
    fs::copy_file(good, p);
    edit(p);
    return p;
  };
  const std::string truncated = variant("truncated.store", [](const std::string& p) {
    fs::resize_file(p, fs::file_size(p) - 64);
  });
  const std::string extended = variant("extended.store", [](const std::string& p) {
    fs::resize_file(p, fs::file_size(p) + 4096);
  });
  const std::string version = variant("version.store", [](const std::string& p) {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    const uint32_t v = 2;
    f.write(reinterpret_cast<const char*>(&v), 4);
  });
  const std::string garbage = dir / "garbage.store";
  std::ofstream(garbage) << std::string(8192, 'x');
  const std::string tiny = dir / "tiny.store";
  std::ofstream(tiny) << "";

  for (const auto& [p, what] : std::vector<std::pair<std::string, std::string>>{
           {truncated, "truncated"}, {extended, "truncated or extended"}, {version, "version 2"},
           {garbage, "not an expert store"}, {tiny, "not an expert store"}}) {
    const std::string before = read_all(p);
    expect_open_error(p, small_spec(), what);
    EXPECT_EQ(read_all(p), before) << p << " was modified by a failed open";
  }
  ExpertStoreSpec other = small_spec();
  other.groups[3].experts = 4;
  expect_open_error(good, other, "another expert layout");
  ExpertStoreSpec same_size = small_spec();  // same byte count, different layout: the hash tells
  same_size.groups[0].tensors[1].decay = true;
  expect_open_error(good, same_size, "another expert layout");
  EXPECT_NO_THROW(ExpertStore::open(good, small_spec()));
}

TEST(ExpertStoreBadFiles, SecondOpenOfAStoreInUseIsAnError) {
  TempDir dir;
  const std::string p = dir / "e.store";
  ExpertStore a = ExpertStore::open(p, small_spec());
  expect_open_error(p, small_spec(), "in use");
}

TEST(ExpertStoreBadFiles, UnwritablePathsAreClearErrors) {
  TempDir dir;
  expect_open_error(dir / "no-such-dir/e.store", small_spec(), "cannot create");
  fs::create_directory(dir / "a-directory");
  expect_open_error(dir / "a-directory", small_spec(), "cannot open");
  // A read-only directory (root ignores permission bits, so this part needs a normal user).
  fs::create_directory(dir / "ro");
  fs::permissions(dir / "ro", fs::perms::owner_read | fs::perms::owner_exec);
  if (::access((dir / "ro").c_str(), W_OK) != 0)
    expect_open_error(dir / "ro/e.store", small_spec(), "cannot create");
  // A read-only existing store file.
  { ExpertStore st = ExpertStore::open(dir / "ro-file.store", small_spec()); }
  fs::permissions(dir / "ro-file.store", fs::perms::owner_read);
  if (::access((dir / "ro-file.store").c_str(), W_OK) != 0)
    expect_open_error(dir / "ro-file.store", small_spec(), "cannot open");
}

// A full disk while creating the store: simulated with a file-size limit, which makes the
// space reservation fail like ENOSPC does. The partial file is removed.
TEST(ExpertStoreBadFiles, NoSpaceWhenCreatingIsAClearErrorAndLeavesNoFile) {
  TempDir dir;
  ExpertStoreSpec big;
  big.groups = {rre_group_spec(0, 0, 8, 256, 1024)};  // 8 experts * 3 * 525k floats ~ 50 MB
  rlimit old{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &old), 0);
  rlimit lim = old;
  lim.rlim_cur = 1 << 20;
  const auto old_handler = std::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &lim), 0);
  const std::string p = dir / "big.store";
  expect_open_error(p, big, "disk full or file size limit");
  ::setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, old_handler);
  EXPECT_TRUE(fs::is_empty(dir.path)) << "a partial store file was left behind";
}

}  // namespace

// The gradient area (src/ecss/gradient_area.h) zeroes a step's slots in place in RAM: the pages
// stay, so the next step adds into memory already there instead of faulting every page in
// again (12-14 us a 4 KiB page on these VMs: 30 % of the default job's step). In a file the
// range reads zero again too. Fails where zero() hands the RAM pages back (MADV_DONTNEED).
TEST(GradientAreaTest, ZeroKeepsRamPagesAndReadsZeroEverywhere) {
  const long page = sysconf(_SC_PAGESIZE);
  const int64_t floats = 3 * page / 4 + 5;  // 4 pages a slot, the last one partly used
  TempDir tmp("grad_area");
  const std::string beside = tmp / "store.bin";
  std::ofstream(beside).put('x');
  for (const std::string& where : {std::string(), beside}) {
    GradientArea area(3, floats, where);
    ASSERT_EQ(area.file_backed(), !where.empty());
    for (int64_t s = 0; s < 3; ++s)
      for (int64_t k = 0; k < floats; ++k) area.slot(s)[k] = float(s + 1) + float(k);
    area.zero(0, 2);
    for (int64_t s = 0; s < 2; ++s)
      for (int64_t k = 0; k < floats; k += 97) ASSERT_EQ(area.slot(s)[k], 0.0f) << where << s << k;
    EXPECT_EQ(area.slot(2)[7], 10.0f) << "a slot outside the range was touched";
    if (area.file_backed()) continue;
    std::vector<unsigned char> v(size_t(2 * GradientArea::bytes_for(1, floats) / uint64_t(page)));
    ASSERT_EQ(mincore(area.slot(0), v.size() * size_t(page), v.data()), 0);
    EXPECT_EQ(std::count_if(v.begin(), v.end(), [](unsigned char x) { return x & 1; }),
              int64_t(v.size()))
        << "zeroed RAM slots lost their pages: the next step faults them in again";
  }
  GradientArea area(2, 8, "");
  EXPECT_THROW(area.zero(1, 2), Error);  // past the last slot
}
