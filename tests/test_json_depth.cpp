// JSON nested a million levels deep (2 MB) in each file Sigma parses: refused with an error
// naming the file, not a stack overflow when an error message prints the value or a copy
// recurses (core/json_depth.h). A config file crashed `sigma train` before the limit; the
// other parsers share it so that no later check or message can reach such a value.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>

#include "core/json_depth.h"
#include "data/jsonl.h"
#include "data/prepare.h"
#include "data/shards.h"
#include "data/tokenizer.h"
#include "eval/tasks.h"
#include "io/checkpoint_dir.h"
#include "run/config.h"

using namespace sigma;
namespace fs = std::filesystem;

namespace {

std::string nested(size_t levels) { return std::string(levels, '[') + std::string(levels, ']'); }

struct TempDir {
  fs::path path = fs::temp_directory_path() / ("sigma-json-depth-" + std::to_string(::getpid()));
  TempDir() { fs::create_directories(path); }
  ~TempDir() { fs::remove_all(path); }
};

// `read` must throw sigma::Error saying the nesting is too deep.
void expect_refused(const std::string& what, const std::function<void()>& read) {
  try {
    read();
    ADD_FAILURE() << what << ": accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nested deeper than 64 levels"), std::string::npos)
        << what << ": " << e.what();
  }
}

}  // namespace

TEST(JsonDepth, EveryFileParserRefusesDeepNesting) {
  TempDir t;
  const std::string deep = nested(1000000);
  auto write = [&](const std::string& name, const std::string& text) {
    const std::string p = (t.path / name).string();
    std::ofstream(p) << text;
    return p;
  };
  const std::string config = write("config.json", "{\"model\": {\"d_model\": " + deep + "}}");
  expect_refused("config file", [&] { Config().load(config, {}); });
  expect_refused("--set value", [&] { Config().load("", {"model.d_model=" + nested(60000)}); });
  const std::string tok = write("tok.json", "{\"vocab_size\": " + deep + "}");
  expect_refused("tokenizer", [&] { data::Tokenizer::load(tok); });
  const std::string prep = write("prepare.json", "{\"corpus\": " + deep + "}");
  expect_refused("prepare config", [&] { data::PrepareConfig::load(prep); });
  fs::create_directories(t.path / "shards");
  write("shards/manifest.json", "{\"format\": " + deep + "}");
  expect_refused("shard manifest", [&] { data::ShardSet::open((t.path / "shards").string(), 0); });
  fs::create_directories(t.path / "ckpt");
  write("ckpt/manifest.json", "{\"version\": " + deep + "}");
  expect_refused("checkpoint manifest", [&] { read_manifest((t.path / "ckpt").string()); });
}

// Line-oriented readers count or name a deep line like any malformed one: a JSONL corpus skips
// it (counted, the lines around it read) and a task file names its line.
TEST(JsonDepth, DeepLinesAreBadLinesNotCrashes) {
  TempDir t;
  const std::string corpus = (t.path / "c.jsonl").string();
  std::ofstream(corpus) << R"({"text": "one", "domain": "en"})" << "\n"
                        << "{\"text\": \"deep\", \"x\": " << nested(1000000) << "}\n"
                        << R"({"text": "two", "domain": "en"})" << "\n";
  data::ReadOptions opt;
  opt.domains = {"en"};
  data::ReadStats st;
  std::vector<std::string> texts;
  data::read_corpus(data::expand_corpus({corpus}), opt, st, [&](data::Record& r) { texts.push_back(r.text); });
  EXPECT_EQ(texts, (std::vector<std::string>{"one", "two"}));
  EXPECT_EQ(st.bad_json, 1u);

  const std::string tasks = (t.path / "t.jsonl").string();
  std::ofstream(tasks) << "{\"type\": " << nested(100000) << "}\n";
  try {
    eval::read_task_file(tasks, {});
    ADD_FAILURE() << "a deep task line was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(":1"), std::string::npos) << e.what();
  }

  EXPECT_TRUE(parse_json_or_discard(nested(66)).is_discarded());  // the outer array is level 0
  EXPECT_FALSE(parse_json_or_discard(nested(65)).is_discarded());
  EXPECT_EQ(parse_json_or_discard(std::string("{\"a\": [1, 2]}")), nlohmann::json::parse("{\"a\": [1, 2]}"));
  EXPECT_TRUE(parse_json_or_discard(std::string("{\"a\": ")).is_discarded());
}

TEST(JsonDepth, TheLimitIsSixtyFourLevels) {
  const auto parse = [](const std::string& s) { return nlohmann::json::parse(s, json_depth_limit("x")); };
  EXPECT_NO_THROW(parse("{\"a\": " + nested(64) + "}"));  // the object is level 0
  EXPECT_THROW(parse("{\"a\": " + nested(65) + "}"), Error);
}
