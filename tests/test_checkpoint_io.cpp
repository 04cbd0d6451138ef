// Checkpoint directories: commit, replace and `latest`; verification names the broken file;
// a save that fails part way leaves the previous checkpoint and `latest` untouched.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/checkpoint_dir.h"

#include "cli_util.h"

using namespace sigma;
namespace fs = std::filesystem;

namespace {

using sigma::testing::TempDir;

std::string read_text(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

void write_text(const fs::path& p, const std::string& s) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f << s;
}

// A small model whose values depend on `step`, so two saves are distinguishable.
TensorMap model_at(int step) {
  TensorMap m;
  Tensor w = Tensor::f32({4, 3});
  for (int i = 0; i < 12; ++i) w.f()[i] = step + i * 0.125f;
  Tensor r(DType::I32, {5});
  for (int i = 0; i < 5; ++i) r.data<int32_t>()[i] = (step + i) % 3;
  m.emplace("blocks.0.w", std::move(w));
  m.emplace("routing.0.python", std::move(r));
  return m;
}

// Saves a full checkpoint the way the trainer will.
std::string save(const std::string& root, const std::string& name, int step,
                 const std::string& tokenizer) {
  TensorMap model = model_at(step), opt = model_at(step + 1000);
  CheckpointWriter w(root, name);
  w.add_safetensors(kModelFile, tensor_refs(model), {{"config", R"({"d": 3})"}});
  w.add_safetensors(kOptimizerFile, tensor_refs(opt), {});
  w.add_json(kTrainerFile, {{"step", step}, {"rng", {1, 2, 3}}});
  w.add_file_copy("tokenizer.json", tokenizer);
  return w.commit();
}

float first_weight(const std::string& dir) {
  return read_safetensors((fs::path(dir) / kModelFile).string()).tensors.at("blocks.0.w").f()[0];
}

// Names in `root` other than checkpoints and `latest`: temp or aside dirs must not linger.
std::vector<std::string> leftovers(const fs::path& root, const std::vector<std::string>& keep) {
  std::vector<std::string> r;
  for (const auto& e : fs::directory_iterator(root)) {
    std::string n = e.path().filename().string();
    if (n != kLatestFile && n != "tok.json" && std::find(keep.begin(), keep.end(), n) == keep.end())
      r.push_back(n);
  }
  return r;
}

void expect_verify_error(const std::string& dir, const std::vector<std::string>& parts) {
  try {
    verify_checkpoint(dir);
    ADD_FAILURE() << "verify_checkpoint accepted " << dir;
  } catch (const Error& e) {
    for (const auto& p : parts)
      EXPECT_NE(std::string(e.what()).find(p), std::string::npos)
          << "message lacks '" << p << "': " << e.what();
  }
}

}  // namespace

TEST(Checkpoint, CommitWritesEveryFileManifestAndLatest) {
  TempDir t;
  const fs::path tok = t.path / "tok.json";
  write_text(tok, R"({"vocab": ["a", "b"]})");
  const std::string root = (t.path / "ckpts").string();  // created on demand
  const std::string dir = save(root, "step_000010", 10, tok.string());

  EXPECT_EQ(dir, (fs::path(root) / "step_000010").string());
  for (const char* f : {kModelFile, kOptimizerFile, kTrainerFile, "tokenizer.json", kManifestFile})
    EXPECT_TRUE(fs::is_regular_file(fs::path(dir) / f)) << f;
  EXPECT_EQ(read_text(fs::path(root) / kLatestFile), "step_000010\n");
  EXPECT_EQ(read_text(fs::path(dir) / "tokenizer.json"), read_text(tok));
  EXPECT_EQ(nlohmann::json::parse(read_text(fs::path(dir) / kTrainerFile))["step"], 10);
  EXPECT_TRUE(leftovers(root, {"step_000010"}).empty());

  auto m = nlohmann::json::parse(read_text(fs::path(dir) / kManifestFile));
  ASSERT_EQ(m["files"].size(), 4u);
  EXPECT_EQ(m["files"][kModelFile]["size"], fs::file_size(fs::path(dir) / kModelFile));
  EXPECT_EQ(m["files"][kModelFile]["xxh3_64"].get<std::string>().size(), 16u);

  EXPECT_NO_THROW(verify_checkpoint(dir));
  EXPECT_EQ(resolve_checkpoint(root), dir);
  EXPECT_EQ(resolve_checkpoint(dir), dir);
  Safetensors model = read_safetensors((fs::path(dir) / kModelFile).string());
  EXPECT_EQ(model.metadata.at("config"), R"({"d": 3})");
  EXPECT_EQ(model.tensors.at("blocks.0.w").f()[5], 10 + 5 * 0.125f);
}

// A run's folder (sigma train --out RUN) stands for its newest checkpoint, RUN/checkpoints'
// `latest`; a folder with neither a checkpoint nor a run's checkpoints is refused by name, one
// whose `checkpoints` links back to itself too (one level is looked into, not more).
TEST(Checkpoint, ARunsFolderResolvesToItsLatestCheckpoint) {
  TempDir t;
  const fs::path tok = t.path / "tok.json";
  write_text(tok, "tok");
  const fs::path run = t.path / "run";
  save((run / kRunCheckpointsDir).string(), "step-1", 1, tok.string());
  const std::string two = save((run / kRunCheckpointsDir).string(), "step-2", 2, tok.string());
  EXPECT_EQ(resolve_checkpoint(run.string()), two);
  fs::create_directories(t.path / "empty" / kRunCheckpointsDir);
  fs::create_directories(t.path / "other");
  fs::create_directories(t.path / "loop");
  fs::create_directory_symlink(".", t.path / "loop" / kRunCheckpointsDir);  // refused, not recursed
  for (const char* bad : {"empty", "other", "loop"}) {
    try {
      resolve_checkpoint((t.path / bad).string());
      ADD_FAILURE() << bad << " resolved";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("is not a checkpoint"), std::string::npos) << e.what();
      if (std::string(bad) == "loop")  // the one level looked into, named
        EXPECT_NE(std::string(e.what()).find("loop/checkpoints' is not"), std::string::npos) << e.what();
    }
  }
}

TEST(Checkpoint, TempDirExistsOnlyWhileWriting) {
  TempDir t;
  CheckpointWriter w(t.str(), "s1");
  EXPECT_EQ(w.temp_dir(), (t.path / fmt::format("s1.tmp-{}", ::getpid())).string());
  EXPECT_TRUE(fs::is_directory(w.temp_dir()));
  EXPECT_FALSE(fs::exists(t.path / kLatestFile));
  w.add_json(kTrainerFile, {{"step", 1}});
  w.commit();
  EXPECT_FALSE(fs::exists(w.temp_dir()));
  EXPECT_THROW(w.add_json("late.json", {}), Error);
  EXPECT_THROW(w.commit(), Error);
}

TEST(Checkpoint, ReplacingANameAndMovingLatest) {
  TempDir t;
  const fs::path tok = t.path / "tok.json";
  write_text(tok, "tok");
  const std::string a = save(t.str(), "a", 1, tok.string());
  save(t.str(), "a", 2, tok.string());  // same name: replaced once the new one is complete
  EXPECT_EQ(first_weight(a), 2.0f);
  EXPECT_NO_THROW(verify_checkpoint(a));
  EXPECT_EQ(resolve_checkpoint(t.str()), a);

  const std::string b = save(t.str(), "b", 3, tok.string());
  EXPECT_EQ(resolve_checkpoint(t.str()), b);
  EXPECT_EQ(first_weight(a), 2.0f);  // older checkpoints stay
  EXPECT_EQ(first_weight(b), 3.0f);
  EXPECT_TRUE(leftovers(t.path, {"a", "b"}).empty());
}

TEST(Checkpoint, VerifyNamesTheCorruptedTruncatedOrMissingFile) {
  TempDir t;
  const fs::path tok = t.path / "tok.json";
  write_text(tok, "tokenizer bytes");
  const std::string dir = save(t.str(), "c", 5, tok.string());

  const fs::path model = fs::path(dir) / kModelFile;
  const std::string good = read_text(model);
  std::string bad = good;
  bad[bad.size() - 3] ^= 0x10;  // one bit in the data: same size, still a valid safetensors
  write_text(model, bad);
  expect_verify_error(dir, {kModelFile, "corrupted"});
  write_text(model, good);
  EXPECT_NO_THROW(verify_checkpoint(dir));

  const fs::path opt = fs::path(dir) / kOptimizerFile;
  fs::resize_file(opt, fs::file_size(opt) - 1);
  expect_verify_error(dir, {kOptimizerFile, "bytes"});

  fs::remove(opt);
  expect_verify_error(dir, {kOptimizerFile, "missing"});

  fs::remove(fs::path(dir) / kManifestFile);
  expect_verify_error(dir, {kManifestFile});
  EXPECT_THROW(resolve_checkpoint(t.str()), Error);  // `latest` names an incomplete dir

  write_text(fs::path(dir) / kManifestFile, "{not json");
  expect_verify_error(dir, {kManifestFile, "not valid JSON"});
  write_text(fs::path(dir) / kManifestFile,
             R"({"format": "sigma-checkpoint", "version": 1, "files": {"../x": {"size": 0, "xxh3_64": "0"}}})");
  expect_verify_error(dir, {"../x"});
}

TEST(Checkpoint, FailureMidWriteLeavesPreviousCheckpointAndLatestIntact) {
  TempDir t;
  const fs::path tok = t.path / "tok.json";
  write_text(tok, "tok");
  const std::string dir = save(t.str(), "ckpt", 1, tok.string());
  const std::string manifest = read_text(fs::path(dir) / kManifestFile);

  std::string tmp;
  {  // a library error part way: the tokenizer source is gone
    TensorMap model = model_at(2);
    CheckpointWriter w(t.str(), "ckpt");
    tmp = w.temp_dir();
    w.add_safetensors(kModelFile, tensor_refs(model), {});
    EXPECT_THROW(w.add_file_copy("tokenizer.json", (t.path / "gone.json").string()), Error);
  }
  EXPECT_FALSE(fs::exists(tmp));
  try {  // any exception from the caller between adds and commit
    TensorMap model = model_at(3);
    CheckpointWriter w(t.str(), "ckpt");
    w.add_safetensors(kModelFile, tensor_refs(model), {});
    throw std::runtime_error("trainer died");
  } catch (const std::runtime_error&) {
  }
  {  // a bad tensor makes the safetensors write itself fail
    CheckpointWriter w(t.str(), "newer");
    EXPECT_THROW(w.add_safetensors(kModelFile, {{"x", DType::F32, {4}, nullptr}}, {}), Error);
  }

  EXPECT_TRUE(leftovers(t.path, {"ckpt"}).empty());
  EXPECT_EQ(read_text(fs::path(t.path) / kLatestFile), "ckpt\n");
  EXPECT_EQ(read_text(fs::path(dir) / kManifestFile), manifest);
  EXPECT_NO_THROW(verify_checkpoint(dir));
  EXPECT_EQ(first_weight(dir), 1.0f);
}

TEST(Checkpoint, RejectsBadNamesAndResolvesOnlyRealCheckpoints) {
  TempDir t;
  for (const char* bad : {"", ".", "..", "a/b", "../up", "latest", "x.tmp-1"})
    EXPECT_THROW(CheckpointWriter(t.str(), bad), Error) << bad;
  CheckpointWriter w(t.str(), "ok");
  for (const char* bad : {"", "..", "sub/file", kManifestFile})
    EXPECT_THROW(w.add_json(bad, {}), Error) << bad;
  w.add_json("a.json", {});
  EXPECT_THROW(w.add_json("a.json", {}), Error);  // added twice

  EXPECT_THROW(resolve_checkpoint((t.path / "nowhere").string()), Error);
  EXPECT_THROW(resolve_checkpoint(t.str()), Error);  // neither manifest nor latest
  write_text(t.path / kLatestFile, "../../etc\n");
  EXPECT_THROW(resolve_checkpoint(t.str()), Error);
  write_text(t.path / kLatestFile, "missing\n");
  EXPECT_THROW(resolve_checkpoint(t.str()), Error);
}
