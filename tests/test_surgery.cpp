// Model surgery (DESIGN §4): inherit computes the dense function, extract and add/remove keep
// the other domains' bits, extract is idempotent through the file format, and bad input fails
// with a clear error and no output directory.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "cli_util.h"
#include "test_util.h"
#include "core/rng.h"
#include "data/tokenizer.h"
#include "model/model.h"
#include "model/names.h"
#include "surgery/surgery.h"
#include "train/checkpoint.h"

using namespace sigma;
using namespace sigma::surgery;
using namespace sigma::testing;
namespace fs = std::filesystem;

namespace {

// Tiny models: one thread avoids OpenMP spin-waits on a shared machine (same bits either way).
const int kOneThread = (omp_set_num_threads(1), 0);

Config dense_config(int vocab = 13) {
  Config c;
  ModelConfig& m = c.model;
  m.vocab = vocab;
  m.d_model = 12;
  m.heads = 3;
  m.context = 6;
  m.layers = 3;
  m.slots = 1;
  m.init_std = 0.3f;  // large, so every tensor visibly matters
  m.rre_layers = 0;
  m.groups.clear();
  m.domains = {{"a", "a", 0}, {"b", "b", 0}, {"c", "c", 0}};
  return c;
}

// Blocks 1-2 RRE; two domains share g1 on different slots.
Config sparse_config(int vocab = 13) {
  Config c = dense_config(vocab);
  c.model.slots = 2;
  c.model.rre_layers = 2;
  c.model.groups = {{"g1", 3}, {"g2", 2}};
  c.model.domains = {{"a", "g1", 0}, {"b", "g2", 1}, {"c", "g1", 1}};
  c.model.routing_seed = 17;
  return c;
}

NamedModel save_and_read(Config cfg, uint64_t seed, const std::string& root,
                         const std::string& tokenizer = "") {
  Model m(cfg.model, seed);
  save_checkpoint(root, cfg, m, nullptr, TrainerState{}, tokenizer);
  return read_model(root);
}

// Rows of one domain (by name), random tokens and targets.
Batch batch_of(const ModelConfig& c, const std::string& domain, int B, uint64_t seed) {
  Batch b;
  b.resize(B, c.context);
  Rng r(seed, 7);
  for (int row = 0; row < B; ++row) b.domain[row] = c.domain_index(domain);
  for (size_t i = 0; i < b.tokens.size(); ++i) {
    b.tokens[i] = int32_t(r.below(uint32_t(c.vocab)));
    b.targets[i] = int32_t(r.below(uint32_t(c.vocab)));
  }
  return b;
}

struct Pass {
  std::vector<float> logits, loss;
};
Pass run(Model& m, Batch b, const std::string& domain) {
  for (auto& d : b.domain) d = m.config().domain_index(domain);  // same name, this model's index
  Pass p;
  p.loss.resize(b.tokens.size());
  m.forward(b, p.loss.data());
  p.logits = m.logits();
  return p;
}

std::unique_ptr<Model> load(const std::string& path) { return load_checkpoint_model(path); }

template <class Fn>
void expect_error(Fn&& fn, const std::string& needle) {
  try {
    fn();
    ADD_FAILURE() << "no error; expected one mentioning " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace

TEST(Inherit, SameTokenizerComputesTheDenseFunctionOnEveryDomain) {
  TempDir tmp("surg-inherit");
  NamedModel dense = save_and_read(dense_config(), 5, tmp / "dense");
  InheritReport rep;
  NamedModel sp = inherit(dense, sparse_config(), {}, &rep);
  EXPECT_EQ(rep.kept_rows, 13);
  EXPECT_EQ(rep.composed_rows + rep.mean_rows, 0);
  // Tensors: experts are the dense FFN, shared tensors copied, both slots dense slot 0.
  for (const auto& [name, t] : sp.tensors) {
    if (t.dtype() != DType::F32) continue;
    const std::string g = names::group_of(name);
    const Tensor& src = name == "embed.tokens" ? dense.tensors.at(name)
                        : g.empty()            ? dense.tensors.at(name)
                                               : dense.tensors.at(fmt::format(
                                                     "blocks.{}.ffn.{}", names::block_of(name),
                                                     names::leaf_of(name)));
    ASSERT_EQ(t.numel() % src.numel(), 0) << name;
    for (int64_t k = 0; k < t.numel() / src.numel(); ++k)
      EXPECT_EQ(0, std::memcmp(t.f() + k * src.numel(), src.f(), src.nbytes())) << name << " " << k;
  }
  const std::string dir = write_model(tmp / "sparse", sp);
  auto sm = load(dir);
  auto dm = load(tmp / "dense");
  // Logits on every domain: each row of domain x runs through some copy of the dense FFN; the
  // experts' GEMMs have fewer rows than the dense one, and oneDNN may round a row differently
  // at another matrix height, so equality is to 1e-6 rather than in bits.
  for (const char* dom : {"a", "b", "c"}) {
    Batch b = batch_of(sm->config(), dom, 4, 11);
    const Pass want = run(*dm, b, dom), got = run(*sm, b, dom);
    float worst = 0;
    for (size_t i = 0; i < want.logits.size(); ++i)
      worst = std::max(worst, std::fabs(want.logits[i] - got.logits[i]));
    EXPECT_LE(worst, 1e-6f) << dom;
    RecordProperty(std::string("max_abs_diff_") + dom, fmt::format("{:.3g}", worst));
  }
  // One batch mixing every domain, larger: rows of one expert now come from several domains.
  Batch mixed = batch_of(sm->config(), "a", 12, 12);
  for (int r = 0; r < mixed.B; ++r) mixed.domain[size_t(r)] = r % 3;
  std::vector<float> l1(mixed.tokens.size()), l2(mixed.tokens.size());
  dm->forward(mixed, l1.data());
  std::vector<float> want = dm->logits();
  sm->forward(mixed, l2.data());
  const std::vector<float> got = sm->logits();
  float worst = 0;
  for (size_t i = 0; i < want.size(); ++i) worst = std::max(worst, std::fabs(want[i] - got[i]));
  EXPECT_LE(worst, 1e-6f);
  RecordProperty("max_abs_diff_mixed", fmt::format("{:.3g}", worst));
  // trainer.json at step 0 and no optimizer state (resume starts a fresh one).
  CheckpointInfo info = open_checkpoint(tmp / "sparse");
  EXPECT_EQ(info.state.step, 0);
  EXPECT_FALSE(fs::exists(info.dir + "/optimizer.safetensors"));
}

TEST(Inherit, GrownTokenizerKeepsEveryRowOfASharedString) {
  TempDir tmp("surg-tok");
  std::vector<std::string> small = {"def foo(x): return x + 1\n", "hello world hello world"};
  std::vector<std::string> big = small;
  big.push_back("print(foo(2)) # the quick brown fox jumps over the lazy dog, again and again");
  data::TrainOptions o;
  o.vocab_size = 300;
  auto t1 = data::Tokenizer::train(small, o);
  o.vocab_size = 340;
  o.controls = {"<new>"};
  auto t2 = data::Tokenizer::train(big, o);
  t1.save(tmp / "t1.json");
  t2.save(tmp / "t2.json");
  NamedModel dense = save_and_read(dense_config(int(t1.vocab_size())), 5, tmp / "dense", tmp / "t1.json");
  InheritReport rep;
  Config sc = sparse_config(0);
  NamedModel sp = inherit(dense, sc, {tmp / "t2.json"}, &rep);
  ASSERT_EQ(sp.cfg.model.vocab, int(t2.vocab_size()));
  std::map<std::string, uint32_t> old_ids;  // first (lowest) id per string
  for (uint32_t i = t1.vocab_size(); i-- > 0;) old_ids[(t1.is_control(i) ? "C" : "B") + t1.token_bytes(i)] = i;
  int64_t shared = 0;
  const Tensor& e0 = dense.tensors.at("embed.tokens");
  const Tensor& e1 = sp.tensors.at("embed.tokens");
  const int64_t d = 12, V = t2.vocab_size();
  for (uint32_t i = 0; i < t2.vocab_size(); ++i) {
    auto it = old_ids.find((t2.is_control(i) ? "C" : "B") + t2.token_bytes(i));
    if (it == old_ids.end()) continue;
    ++shared;
    for (int slot = 0; slot < 2; ++slot)
      EXPECT_EQ(0, std::memcmp(e1.f() + (slot * V + i) * d, e0.f() + it->second * d, d * 4)) << i;
  }
  EXPECT_EQ(rep.kept_rows, shared);
  EXPECT_GT(rep.composed_rows, 0);
  EXPECT_EQ(rep.mean_rows, 1);  // the new control <new>
  EXPECT_EQ(rep.kept_rows + rep.composed_rows + rep.mean_rows, V);
  EXPECT_EQ(sp.tokenizer, tmp / "t2.json");
  write_model(tmp / "sparse", sp);
  EXPECT_FALSE(checkpoint_tokenizer_path(open_checkpoint(tmp / "sparse").dir).empty());
  // A tokenizer without the dense controls is refused.
  o.vocab_size = 300;
  o.controls = {"<only-old>"};
  auto t3 = data::Tokenizer::train(small, o);
  t3.save(tmp / "t3.json");
  NamedModel dense3 = save_and_read(dense_config(int(t3.vocab_size())), 5, tmp / "dense3", tmp / "t3.json");
  expect_error([&] { inherit(dense3, sparse_config(0), {tmp / "t1.json"}); }, "<only-old>");
}

TEST(Extract, SubModelLossesAreBitIdenticalAndHoldNoOtherDomain) {
  TempDir tmp("surg-extract");
  NamedModel full = save_and_read(sparse_config(), 3, tmp / "full");
  auto fm = load(tmp / "full");
  for (std::vector<std::string> names : {std::vector<std::string>{"b"}, {"a"}, {"a", "c"}}) {
    NamedModel sub = extract(full, names);
    std::set<std::string> groups;
    for (const auto& n : names) groups.insert(full.cfg.model.domains[size_t(full.cfg.model.domain_index(n))].group);
    for (const auto& [name, t] : sub.tensors) {
      const std::string g = names::group_of(name);
      EXPECT_TRUE(g.empty() || groups.count(g)) << name;
    }
    EXPECT_EQ(sub.cfg.model.domains.size(), names.size());
    const std::string out = tmp / ("sub" + std::to_string(names.size()) + names[0]);
    write_model(out, sub);
    auto sm = load(out);
    EXPECT_LT(sm->params().numel(), fm->params().numel());
    for (const auto& n : names) {
      Batch b = batch_of(full.cfg.model, n, 3, 21);
      const Pass want = run(*fm, b, n), got = run(*sm, b, n);
      EXPECT_TRUE(same_bits(want.loss, got.loss)) << n;
      EXPECT_TRUE(same_bits(want.logits, got.logits)) << n;
    }
    // Extract of the extract equals the extract, through the file format.
    NamedModel again = extract(read_model(out), names);
    ASSERT_EQ(again.tensors.size(), sub.tensors.size());
    for (const auto& [name, t] : sub.tensors)
      EXPECT_EQ(0, std::memcmp(t.bytes(), again.tensors.at(name).bytes(), t.nbytes())) << name;
    EXPECT_EQ(again.cfg.to_json(), sub.cfg.to_json());
  }
  // Narrowing an extract equals extracting directly.
  NamedModel ac = extract(full, {"a", "c"});
  NamedModel a1 = extract(ac, {"a"}), a2 = extract(full, {"a"});
  for (const auto& [name, t] : a2.tensors)
    EXPECT_EQ(0, std::memcmp(t.bytes(), a1.tensors.at(name).bytes(), t.nbytes())) << name;
  expect_error([&] { extract(full, {"poetry"}); }, "unknown domain 'poetry'");
  expect_error([&] { extract(full, {"a", "a"}); }, "named twice");
}

TEST(Domains, AddAndRemoveLeaveTheOtherDomainsBitIdentical) {
  TempDir tmp("surg-domains");
  NamedModel full = save_and_read(sparse_config(), 3, tmp / "full");
  auto fm = load(tmp / "full");
  NamedModel added = add_domain(full, {"d", "g1", 0, ""});
  write_model(tmp / "added", added);
  auto am = load(tmp / "added");
  EXPECT_EQ(am->config().slots, 3);
  for (const char* n : {"a", "b", "c"}) {
    Batch b = batch_of(full.cfg.model, n, 3, 5);
    EXPECT_TRUE(same_bits(run(*fm, b, n).logits, run(*am, b, n).logits)) << n;
  }
  // From g1 with g1's K: the new domain starts as g1's first domain (a, slot 0) computes.
  Batch b = batch_of(full.cfg.model, "a", 3, 6);
  EXPECT_TRUE(same_bits(run(*fm, b, "a").logits, run(*am, b, "d").logits));
  // Another K, from random: still nothing else moves.
  NamedModel r = add_domain(full, {"e", "random", 5, ""});
  write_model(tmp / "random", r);
  auto rm = load(tmp / "random");
  for (const char* n : {"a", "b", "c"}) {
    Batch bb = batch_of(full.cfg.model, n, 3, 8);
    EXPECT_TRUE(same_bits(run(*fm, bb, n).logits, run(*rm, bb, n).logits)) << n;
  }
  // Remove: b (its group and slot go), then the others are unchanged.
  NamedModel rem = remove_domain(added, "b");
  EXPECT_EQ(rem.cfg.model.groups.size(), 1u + 0u + 1u);  // g1 and d
  write_model(tmp / "removed", rem);
  auto xm = load(tmp / "removed");
  for (const char* n : {"a", "c", "d"}) {
    Batch bb = batch_of(full.cfg.model, n == std::string("d") ? "a" : n, 3, 9);
    EXPECT_TRUE(same_bits(run(*am, bb, n).logits, run(*xm, bb, n).logits)) << n;
  }
  expect_error([&] { add_domain(full, {"a", "g1", 0, ""}); }, "domain 'a' already exists");
  expect_error([&] { add_domain(full, {"g2", "g1", 0, ""}); }, "group named 'g2'");
  expect_error([&] { add_domain(full, {"z", "nope", 0, ""}); }, "nope");
  NamedModel one = extract(full, {"b"});
  expect_error([&] { remove_domain(one, "b"); }, "last domain");
}

TEST(Inherit, DenseOfAnotherShapeIsRefused) {
  TempDir tmp("surg-shape");
  NamedModel dense = save_and_read(dense_config(), 5, tmp / "dense");
  Config wide = sparse_config();
  wide.model.d_model = 24;
  expect_error([&] { inherit(dense, wide, {}); }, "model.d_model = 12");
  Config deep = sparse_config();
  deep.model.layers = 4;
  expect_error([&] { inherit(dense, deep, {}); }, "model.layers = 3");
  NamedModel sparse = save_and_read(sparse_config(), 5, tmp / "sparse");
  expect_error([&] { inherit(sparse, sparse_config(), {}); }, "not a dense model");
}

TEST(SurgeryCli, InheritTrainExtractListAndBadInputLeaveNoOutput) {
  TempDir tmp("surg-cli");
  const std::string tiny =
      "--set model.d_model=16 --set model.heads=2 --set model.context=8 --set train.batch=4 "
      "--set train.log_every=2 --set train.eval_rows=4 ";
  auto r = sigma_cmd("train --quiet " + tiny + "--set train.steps=2 --set model.rre_layers=0 "
                     "--set 'model.groups=[]' --out " + tmp / "dense");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ofstream(tmp / "sparse.json") << R"({"model": {"d_model": 16, "heads": 2, "context": 8,
      "rre_layers": 2, "groups": [{"name": "markov", "experts": 2}, {"name": "copy", "experts": 3},
      {"name": "arith", "experts": 2}]}, "train": {"batch": 4, "log_every": 2, "eval_rows": 4,
      "steps": 4}})";
  r = sigma_cmd("inherit --from " + tmp / "dense/checkpoints --config " + tmp / "sparse.json" +
                " --out " + tmp / "sparse");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("rows kept"), std::string::npos) << r.out;
  r = sigma_cmd("train --quiet --resume " + tmp / "sparse --out " + tmp / "run");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("domains list --json --ckpt " + tmp / "run/checkpoints");
  ASSERT_EQ(r.code, 0) << r.out;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["domains"].size(), 3u);
  EXPECT_EQ(j["groups"][1]["experts"], 3);
  r = sigma_cmd("extract --ckpt " + tmp / "run/checkpoints --domain copy --out " + tmp / "copy");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("bytes"), std::string::npos) << r.out;
  r = sigma_cmd("generate --ckpt " + tmp / "copy --prompt '1 5 6' --max-new 3 --domain copy");
  EXPECT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("domains add --ckpt " + tmp / "copy --name poems --init-from copy --out " + tmp / "added");
  ASSERT_EQ(r.code, 0) << r.out;

  auto refused = [&](const std::string& args, const std::string& needle) {
    auto b = sigma_cmd(args + " --out " + tmp / "bad");
    EXPECT_NE(b.code, 0) << b.out;
    EXPECT_NE(b.out.find(needle), std::string::npos) << b.out;
    EXPECT_FALSE(fs::exists(tmp / "bad")) << args;
  };
  refused("extract --ckpt " + tmp / "copy --domain markov", "unknown domain 'markov'");
  refused("domains add --ckpt " + tmp / "copy --name copy --init-from copy", "already exists");
  refused("domains remove --ckpt " + tmp / "copy --name copy", "last domain");
  refused("inherit --from " + tmp / "dense/checkpoints --config " + tmp / "sparse.json" +
              " --set model.layers=4", "model.layers = 3");
  // An existing, non-empty output is never overwritten.
  r = sigma_cmd("extract --ckpt " + tmp / "run/checkpoints --domain copy --out " + tmp / "copy");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("not empty"), std::string::npos) << r.out;
}

// Without --config, inherit starts from the dense checkpoint's own config and applies --set.
TEST(SurgeryCli, InheritWithSetAloneStartsFromTheDenseConfig) {
  TempDir tmp("surg-set");
  auto r = sigma_cmd("train --quiet --set model.d_model=16 --set model.heads=2 --set model.context=8 "
                     "--set train.batch=4 --set train.log_every=2 --set train.eval_rows=4 "
                     "--set train.steps=2 --set model.rre_layers=0 --set 'model.groups=[]' --out " +
                     tmp / "dense");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("inherit --from " + tmp / "dense/checkpoints --set model.rre_layers=1 --set "
                "'model.groups=[{\"name\":\"markov\",\"experts\":2},{\"name\":\"copy\",\"experts\":3},"
                "{\"name\":\"arith\",\"experts\":2}]' --out " + tmp / "sparse");
  ASSERT_EQ(r.code, 0) << r.out;
  Config dense = open_checkpoint(tmp / "dense/checkpoints").cfg;
  Config sparse = open_checkpoint(tmp / "sparse").cfg;
  EXPECT_EQ(sparse.model.rre_layers, 1);
  ASSERT_EQ(sparse.model.groups.size(), 3u);
  EXPECT_EQ(sparse.model.groups[1].experts, 3);
  // Everything else is the dense model's: width, context, domains, training keys, data.
  nlohmann::json d = dense.to_json(), s = sparse.to_json();
  for (const char* k : {"rre_layers", "groups"}) d["model"].erase(k), s["model"].erase(k);
  EXPECT_EQ(d, s);
  r = sigma_cmd("train --quiet --resume " + tmp / "sparse --set train.steps=2 --out " + tmp / "run");
  EXPECT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("inherit --from " + tmp / "dense/checkpoints --out " + tmp / "nothing");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("--set"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(tmp / "nothing"));
}
