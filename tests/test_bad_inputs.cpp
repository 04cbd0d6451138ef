// Bad inputs from issue 15, each refused with an error naming what and where: sampling
// parameters, shard bodies, trainer.json, manifests, expert store headers, config keys the
// run would ignore, relative tokenizer paths, thread counts, models too big for the machine.
#include <gtest/gtest.h>
#include <omp.h>
#include <xxhash.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <regex>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "test_util.h"
#include "core/refusal.h"
#include "data/shards.h"
#include "ecss/expert_store.h"
#include "infer/generate.h"
#include "io/checkpoint_dir.h"
#include "train/checkpoint.h"
#include "run/data_source.h"
#include "train/preflight.h"
#include "train/trainer.h"

using namespace sigma;
using namespace sigma::testing;
namespace fs = std::filesystem;

namespace {

constexpr float kNaNf = std::numeric_limits<float>::quiet_NaN();

void spit(const std::string& path, const std::string& s) { std::ofstream(path, std::ios::binary) << s; }

// ---- sampling ------------------------------------------------------------------------------

TEST(BadInputs, NaNOrOutOfRangeSamplingParametersAreRejected) {
  SamplingConfig ok;
  EXPECT_EQ(error_of([&] { ok.validate(); }), "");
  auto bad = [](auto set) {
    SamplingConfig s;
    set(s);
    return error_of([&] { s.validate(); });
  };
  EXPECT_NE(bad([](SamplingConfig& s) { s.temperature = kNaNf; }).find("temperature nan"), std::string::npos);
  EXPECT_NE(bad([](SamplingConfig& s) { s.top_p = kNaNf; }).find("top-p nan"), std::string::npos);
  EXPECT_NE(bad([](SamplingConfig& s) { s.top_p = 0.0f; }).find("top-p 0"), std::string::npos);
  EXPECT_NE(bad([](SamplingConfig& s) { s.repetition_penalty = kNaNf; }).find("repetition penalty nan"),
            std::string::npos);
  EXPECT_NE(bad([](SamplingConfig& s) { s.temperature = INFINITY; }).find("temperature inf"), std::string::npos);
  EXPECT_NE(bad([](SamplingConfig& s) { s.top_k = -1; }).find("top-k -1"), std::string::npos);
}

TEST(BadInputs, GenerateRefusesNaNSamplingFlags) {
  for (const char* flag : {"--temperature nan", "--top-p nan", "--repetition-penalty nan"}) {
    const auto r = sigma_cmd(std::string("generate --ckpt /nonexistent --prompt 1 ") + flag);
    EXPECT_NE(r.code, 0) << flag;
    EXPECT_NE(r.out.find(" nan is not in"), std::string::npos) << flag << ": " << r.out;
  }
}

// ---- shards --------------------------------------------------------------------------------

std::string write_shard(const std::string& dir) {
  const std::string path = dir + "/d.shard";
  data::ShardWriter w(path, DomainSpec("d", "d", 0), 300, 0x1234, 0x5678);
  w.add(std::vector<uint32_t>{5, 6, 7, 8, 9});
  w.add(std::vector<uint32_t>{10, 11, 12});
  w.finish();
  w.commit();
  return path;
}

TEST(BadInputs, AFlippedTokenOrOffsetInAShardIsRefused) {
  TempDir tmp("shard-sum");
  const std::string path = write_shard(tmp.str());
  ASSERT_NO_THROW(data::Shard::open(path, 0x1234));
  const std::string good = slurp(path);
  const size_t header = sizeof(data::ShardHeader);
  std::string tok = good;
  tok[header + 2] ^= 1;  // token 1: 6 -> 7, still inside the vocabulary
  spit(path, tok);
  std::string e = error_of([&] { data::Shard::open(path, 0x1234); });
  EXPECT_NE(e.find("corrupted"), std::string::npos) << e;
  std::string off = good;
  off[header + 16 + 8] ^= 1;  // offsets[1]: 5 -> 4 (16 bytes of padded u16 tokens come first)
  spit(path, off);
  e = error_of([&] { data::Shard::open(path, 0x1234); });
  EXPECT_NE(e.find("corrupted"), std::string::npos) << e;
  std::string old = good;  // a version-1 shard (no checksum) is sent back to prepare
  old[8] = 1;
  spit(path, old);
  e = error_of([&] { data::Shard::open(path, 0x1234); });
  EXPECT_NE(e.find("version 1, this build reads 3 (older shards do not check their header)"), std::string::npos) << e;
}

// ---- checkpoints ---------------------------------------------------------------------------

// Rewrites one file of checkpoint `dir` and its manifest entry, as a consistent forgery would.
void forge(const std::string& dir, const std::string& file, const std::string& text) {
  spit(dir + "/" + file, text);
  auto m = nlohmann::json::parse(slurp(dir + "/manifest.json"));
  m["files"][file] = {{"size", text.size()},
                      {"xxh3_64", fmt::format("{:016x}", XXH3_64bits(text.data(), text.size()))}};
  spit(dir + "/manifest.json", m.dump());
}

class TinyCheckpoint : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto r = sigma_cmd("train --quiet --set model.d_model=16 --set model.layers=2 --set "
                             "model.heads=2 --set model.context=8 --set train.batch=2 --set "
                             "train.steps=3 --set train.eval_rows=4 --out " + tmp / "out");
    ASSERT_EQ(r.code, 0) << r.out;
    dir = resolve_checkpoint(tmp / "out/checkpoints");
  }
  TempDir tmp{"bad-ckpt"};
  std::string dir;
};

TEST_F(TinyCheckpoint, AnAbsurdOrInconsistentStepInTrainerJsonIsRefused) {
  auto j = nlohmann::json::parse(slurp(dir + "/trainer.json"));
  j["step"] = int64_t(1000000000000000);
  forge(dir, "trainer.json", j.dump());
  std::string e = error_of([&] { open_checkpoint(dir); });
  EXPECT_NE(e.find("step 1000000000000000 / tokens"), std::string::npos) << e;
  j["step"] = 2;  // plausible, but the directory is step-00000003
  forge(dir, "trainer.json", j.dump());
  e = error_of([&] { open_checkpoint(dir); });
  EXPECT_NE(e.find("says step 2 but the checkpoint is 'step-00000003'"), std::string::npos) << e;
}

TEST_F(TinyCheckpoint, AFileWhoseManifestEntryWasDeletedIsRefused) {
  auto m = nlohmann::json::parse(slurp(dir + "/manifest.json"));
  m["files"].erase("optimizer.safetensors");
  spit(dir + "/manifest.json", m.dump());
  const std::string e = error_of([&] { verify_checkpoint(dir); });
  EXPECT_NE(e.find("file 'optimizer.safetensors' is not listed in manifest.json"), std::string::npos) << e;
}

// ---- expert store header -------------------------------------------------------------------

TEST(BadInputs, ExpertStoreHeaderErrorsNameTheFieldThatDiffers) {
  TempDir tmp("store-hdr");
  ExpertStoreSpec spec;
  spec.groups = {rre_group_spec(0, 0, 2, 4, 6)};
  { ExpertStore s = ExpertStore::open(tmp / "s.store", spec); }
  const std::string good = slurp(tmp / "s.store");
  std::string swapped = good;
  swapped[12] = 0x01, swapped[13] = 0x02, swapped[14] = 0x03, swapped[15] = 0x04;  // byte order
  spit(tmp / "s.store", swapped);
  std::string e = error_of([&] { ExpertStore::open(tmp / "s.store", spec); });
  EXPECT_NE(e.find("other byte order"), std::string::npos) << e;
  EXPECT_EQ(e.find("version 1 but this build reads version 1"), std::string::npos) << e;
  std::string hdr = good;
  hdr[16] ^= 0x10;  // header_bytes
  spit(tmp / "s.store", hdr);
  e = error_of([&] { ExpertStore::open(tmp / "s.store", spec); });
  EXPECT_NE(e.find("its header says it is"), std::string::npos) << e;
}

// ---- config keys a run would ignore, paths -------------------------------------------------

TEST(BadInputs, ASamplerWithSyntheticDataIsAnError) {
  Config cfg;
  cfg.data.sampler = nlohmann::json::parse(R"({"stages": [{"steps": 0, "weights": {"markov": 1}}]})");
  const std::string e = error_of([&] { make_data_source(cfg); });
  EXPECT_NE(e.find("data.sampler weights the domains of prepared shards"), std::string::npos) << e;
}

TEST(BadInputs, TheShardManifestsTokenizerPathIsRelativeToTheManifest) {
  TempDir tmp("tok-rel");
  std::ofstream c(tmp / "corpus.jsonl");
  for (int i = 0; i < 40; ++i)
    c << nlohmann::json{{"domain", "prose"}, {"text", "a cat number " + std::to_string(i)}}.dump() << "\n";
  c.close();
  auto r = sigma_cmd("tokenizer train --corpus " + tmp / "corpus.jsonl" + " --vocab-size 280 --out " +
                     tmp / "tok.json");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ofstream(tmp / "data.json") << R"({"tokenizer": "tok.json", "corpus": ["corpus.jsonl"],
                                         "domains": [{"name": "prose"}]})";
  r = run_cmd("cd " + tmp.str() + " && " + SIGMA_BINARY + " prepare --config data.json --out shards");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto m = nlohmann::json::parse(slurp(tmp / "shards/manifest.json"));
  EXPECT_EQ(m["tokenizer"], "../tok.json");
  // From another directory (the test's), the tokenizer is still found next to the shards.
  Config cfg;
  cfg.data.source = "shards";
  cfg.data.path = tmp / "shards";
  auto src = make_data_source(cfg);
  EXPECT_EQ(src->tokenizer_path(), tmp / "tok.json");
}

// A model.vocab that dist.tp does not divide is refused before rank 0 locks --out (the model's
// own check came after: the refused run left OUT/.lock behind), and said once, not per rank.
TEST(BadInputs, AVocabularyTpDoesNotDivideIsRefusedBeforeTheOutputIsLocked) {
  Config cfg;
  cfg.model.vocab = 101;
  cfg.model.heads = 2;
  cfg.dist.tp = 2;
  try {
    check_tensor_parallel(cfg, 2, "model");
    ADD_FAILURE() << "model.vocab = 101 accepted at dist.tp = 2";
  } catch (const Refusal& e) {
    EXPECT_NE(std::string(e.what()).find("set model.vocab = 102"), std::string::npos) << e.what();
  }
  if (!SIGMA_HAS_MPI) GTEST_SKIP() << "built with SIGMA_MPI=OFF: the 2-rank run is not tried";
  TempDir t("vocab_tp");
  const CmdResult r = run_cmd(fmt::format(
      "mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 {} train --config "
      "{}/configs/tiny.json --set model.vocab=101 --set dist.tp=2 --set train.threads=1 --quiet "
      "--out {}", SIGMA_BINARY, SIGMA_SOURCE_DIR, t / "out"));
  EXPECT_NE(r.code, 0);
  EXPECT_FALSE(fs::exists(t / "out")) << "the refused run created its output directory";
  const std::string line = "does not divide model.vocab = 101";
  EXPECT_NE(r.out.find(line), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find(line), r.out.rfind(line)) << "said by each rank: " << r.out;
}

// A tp group must sit inside one host (issue 38's placement rule): hosts as Open MPI sees them
// (hostnames, one per rank in world order; scripts/sim-cluster.sh gives each host its own).
TEST(BadInputs, ATpGroupAcrossHostsIsRefusedWithTheTpThatFits) {
  const std::vector<std::string> two_by_two = {"h0", "h0", "h1", "h1"};
  EXPECT_NO_THROW(check_tp_within_hosts(two_by_two, 1));
  EXPECT_NO_THROW(check_tp_within_hosts(two_by_two, 2));
  EXPECT_EQ(describe_hosts(two_by_two), "h0: ranks 0-1; h1: ranks 2-3");
  try {
    check_tp_within_hosts(two_by_two, 4);
    ADD_FAILURE() << "tp 4 over two hosts of 2 accepted";
  } catch (const Refusal& e) {
    const std::string said = e.what();
    EXPECT_EQ(said.find("dist.tp = 4 puts tp group 0 (ranks 0-3) on more than one host (h0: "
                        "ranks 0-1; h1: ranks 2-3): a tp group"), 0u) << said;
    EXPECT_NE(std::string(e.what()).find("use dist.tp = 2 or 1,"), std::string::npos) << e.what();
  }
  // 3 ranks a host: tp 2 splits group 1 (ranks 2-3) over h0 and h1; only tp 1 and 3 fit.
  const std::vector<std::string> threes = {"a", "a", "a", "b", "b", "b"};
  try {
    check_tp_within_hosts(threes, 2);
    ADD_FAILURE() << "tp 2 over hosts of 3 accepted";
  } catch (const Refusal& e) {
    EXPECT_NE(std::string(e.what()).find("tp group 1 (ranks 2-3) on more than one host (a: "
                                         "ranks 2; b: ranks 3)"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("use dist.tp = 1,"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(check_tp_within_hosts(threes, 3));
  // Ranks placed round-robin (mpirun --map-by node): no tp > 1 fits.
  EXPECT_THROW(check_tp_within_hosts({"a", "b", "a", "b"}, 2), Refusal);
  EXPECT_EQ(describe_hosts({"a", "b", "a", "b"}), "a: ranks 0, 2; b: ranks 1, 3");
  // One process: its own hostname.
  SingleProcess one;
  const std::vector<std::string> mine = hosts_of_ranks(one);
  ASSERT_EQ(mine.size(), 1u);
  EXPECT_FALSE(mine[0].empty());
}

// ---- threads and memory --------------------------------------------------------------------

// Every value a batch refusal suggests is accepted when fed back (issue 38: mpirun -np 5 with
// the main job's 24 rows at train.batch = 24 suggested train.global_batch = 20, which batch 24
// refuses; 10 rows at batch 5 on 4 ranks suggested 8). Swept over ranks, batches and both
// forms of the global batch (train.batch x train.accum, train.global_batch).
TEST(BadInputs, BatchRefusalsSuggestOnlyValuesTheyAccept) {
  auto make = [](int batch, int accum, int global) {
    TrainConfig t;
    t.batch = batch, t.accum = accum, t.global_batch = global;
    return t;
  };
  auto refusal = [](TrainConfig t, int ranks) -> std::string {
    try {
      resolve_batch(t, ranks);
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  };
  // The text between `from` and `to` (or the end) of `s`, "" when `from` is absent.
  auto part = [](const std::string& s, const std::string& from, const std::string& to) {
    const size_t at = s.find(from);
    if (at == std::string::npos) return std::string();
    const size_t begin = at + from.size(), end = s.find(to, begin);
    return s.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
  };
  int suggestions = 0;
  // Calls fn(match) for each match of `re` in `s`.
  auto each = [&](const std::string& s, const std::regex& re, auto fn) {
    for (std::sregex_iterator m(s.begin(), s.end(), re), e; m != e; ++m, ++suggestions) fn(*m);
  };
  EXPECT_EQ(part(refusal(make(24, 1, 0), 5), "nearest valid: ", "\n"),
            "train.global_batch = 20 (with train.batch = 4) or 25 (with train.batch = 5), or "
            "mpirun -np 4 or 6");
  TrainConfig main_job = make(24, 1, 0);
  EXPECT_THROW(resolve_batch(main_job, 5), Refusal) << "printed once, by rank 0 (apps/sigma.cpp)";
  const std::regex global(R"((\d+)(?: \(with train\.batch = (\d+)\))?)"), number(R"(\d+)");
  int refusals = 0;
  for (int R = 1; R <= 8; ++R)
    for (int b = 1; b <= 8; ++b)
      for (int G = 1; G <= 40; ++G)
        for (const TrainConfig& t : {make(b, 1, G), make(b, std::max(1, G / b), 0)}) {
          if (t.global_batch == 0 && G % b != 0) continue;
          const std::string why = refusal(t, R);
          if (why.empty()) continue;
          ++refusals;
          const std::string at = fmt::format("{} ranks, batch {}, global {}: {}", R, b, G, why);
          ASSERT_NE(why.find("nearest valid"), std::string::npos) << at;
          const std::string tail = why.substr(why.find("nearest valid"));
          each(part(tail, "nearest valid on " + std::to_string(R) + " ranks: train.batch = ", ","),
               number, [&](const std::smatch& m) {
                 EXPECT_EQ(refusal(make(std::stoi(m.str()), 1, G), R), "")
                     << "train.batch = " << m.str() << " from " << at;
               });
          each(part(tail, "train.global_batch = ", ", or"), global, [&](const std::smatch& m) {
            const int batch = m[2].matched ? std::stoi(m[2]) : b;
            EXPECT_EQ(refusal(make(batch, 1, std::stoi(m[1])), R), "") << m.str() << " from " << at;
          });
          each(part(tail, "mpirun -np ", "\n"), number, [&](const std::smatch& m) {
            EXPECT_EQ(refusal(t, std::stoi(m.str())), "") << "-np " << m.str() << " from " << at;
          });
        }
  EXPECT_GT(refusals, 500);
  EXPECT_GT(suggestions, 2 * refusals) << "most refusals suggest at least two values";
}

TEST(BadInputs, MoreThreadsThanCoresAreCapped) {
  std::string note;
  EXPECT_EQ(usable_threads(4096, &note), omp_get_num_procs());
  EXPECT_NE(note.find("train.threads = 4096"), std::string::npos) << note;
  note.clear();
  EXPECT_EQ(usable_threads(1, &note), 1);
  EXPECT_EQ(note, "");
  const auto r = sigma_cmd("train --set train.threads=4096 --set train.steps=2 --set model.d_model=16 "
                           "--set model.heads=2 --set model.context=8 --set train.batch=2 --set "
                           "train.eval_rows=4");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find(fmt::format("{} threads", omp_get_num_procs())), std::string::npos) << r.out;
}

TEST(BadInputs, ParameterCountMatchesTheModel) {
  Config dense;
  dense.model.vocab = 37;
  dense.model.rre_layers = 0;
  dense.model.groups.clear();
  Config sparse;
  sparse.model.vocab = 37;
  sparse.model.slots = 2;
  Config gated = sparse;
  gated.model.router = "top2";
  for (Config* c : {&dense, &sparse, &gated}) {
    c->model.domains = {{"markov", "markov", 0}};
    if (c->model.rre_layers) c->model.groups = {{"markov", 3}};
    Model m(c->model, 1);
    EXPECT_EQ(count_params(c->model).total, m.params().numel()) << c->model.router;
  }
}

TEST(BadInputs, AModelTooBigForTheMachineStatesTheMemoryItNeeds) {
  Config cfg;
  cfg.model.vocab = 50000;
  cfg.model.d_model = 16384;
  cfg.model.heads = 128;
  cfg.model.layers = 40;
  const std::string e = error_of([&] { check_memory(cfg); });
  EXPECT_NE(e.find("this config needs about"), std::string::npos) << e;
  EXPECT_NE(e.find("GiB of memory"), std::string::npos) << e;
  EXPECT_EQ(error_of([] { check_memory(Config()); }), "");
  const auto r = sigma_cmd("train --set model.d_model=16384 --set model.heads=128 --set model.layers=40");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("this config needs about"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("bad_alloc"), std::string::npos) << r.out;
}

// ---- the issue's untested bad inputs -------------------------------------------------------

TEST(BadInputs, DModelNotDivisibleByHeadsIsNamed) {
  const auto r = sigma_cmd("train --set model.d_model=30 --set model.heads=4 --set train.steps=1");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("model.d_model"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model.heads"), std::string::npos) << r.out;
}

TEST(BadInputs, AnEmptyCorpusForTokenizerTrainIsAnError) {
  TempDir tmp("tok-empty");
  spit(tmp / "empty.jsonl", "");
  const auto r = sigma_cmd("tokenizer train --corpus " + tmp / "empty.jsonl" + " --vocab-size 280 --out " +
                           tmp / "tok.json");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("no usable record"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(tmp / "tok.json"));
}

// A domain whose shard holds fewer tokens than one context window: packed training says which
// domain has nothing to draw (fine-tuning pads such samples and trains).
TEST(BadInputs, AShardShorterThanTheContextIsNamed) {
  TempDir tmp("short-shard");
  spit(tmp / "c.jsonl", "{\"domain\": \"prose\", \"text\": \"a cat\"}\n");
  auto r = sigma_cmd("tokenizer train --corpus " + tmp / "c.jsonl" + " --vocab-size 290 --out " + tmp / "tok.json");
  ASSERT_EQ(r.code, 0) << r.out;
  spit(tmp / "d.json", R"({"tokenizer": "tok.json", "corpus": ["c.jsonl"], "domains": [{"name": "prose"}]})");
  r = sigma_cmd("prepare --config " + tmp / "d.json" + " --out " + tmp / "shards");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string train = "train --quiet --set data.source=shards --set data.path=" + tmp / "shards" +
                            " --set model.context=64 --set model.d_model=16 --set model.heads=2 "
                            "--set train.steps=2 --set train.batch=2 --set model.rre_layers=0 "
                            "--set 'model.groups=[]' ";
  r = sigma_cmd(train);
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("domain 'prose', which has nothing to draw"), std::string::npos) << r.out;
  r = sigma_cmd(train + "--set data.finetune=true");
  EXPECT_EQ(r.code, 0) << r.out;
}

// A write failure in prepare (a full disk, here a file-size limit: write(2) fails with EFBIG
// as it would with ENOSPC) is an error naming the file, and leaves no shard under its name.
TEST(BadInputs, AWriteFailureDuringPrepareLeavesNoShard) {
  TempDir tmp("prep-full");
  std::ofstream c(tmp / "corpus.jsonl");
  for (int i = 0; i < 3000; ++i)
    c << nlohmann::json{{"domain", "prose"}, {"text", "the cat sat on mat " + std::to_string(i)}}.dump() << "\n";
  c.close();
  auto r = sigma_cmd("tokenizer train --corpus " + tmp / "corpus.jsonl" + " --vocab-size 280 --out " +
                     tmp / "tok.json");
  ASSERT_EQ(r.code, 0) << r.out;
  std::ofstream(tmp / "data.json") << R"({"tokenizer": "tok.json", "corpus": ["corpus.jsonl"],
                                         "domains": [{"name": "prose"}]})";
  // 64 blocks of 512 bytes: the tokenizer and corpus are read, the shard cannot be written.
  r = run_cmd("trap '' XFSZ; ulimit -f 64; " + std::string(SIGMA_BINARY) + " prepare --config " +
              tmp / "data.json" + " --out " + tmp / "shards");
  EXPECT_NE(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("File too large"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(tmp / "shards/prose.shard"));
  EXPECT_FALSE(fs::exists(tmp / "shards/manifest.json"));
}

}  // namespace
