// The configs shipped in configs/ and the ones the docs name: each exists and loads, so a
// documented command never starts with "file does not exist" or an unknown key.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "cli_util.h"
#include "test_util.h"
#include "model/domains.h"
#include "data/prepare.h"
#include "run/config.h"

using namespace sigma;
using namespace sigma::testing;
namespace fs = std::filesystem;

namespace {

const fs::path kRoot = SIGMA_SOURCE_DIR;

// A training config has only model / optim / train / data sections; the others are data
// configs for `sigma prepare` (a domain registry, with or without its corpus and tokenizer).
bool is_train_config(const nlohmann::json& j) {
  for (const auto& [k, v] : j.items())
    if (k != "model" && k != "optim" && k != "train" && k != "data") return false;
  return true;
}

TEST(Configs, EveryShippedConfigLoads) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(kRoot / "configs")) {
    if (e.path().extension() != ".json") continue;
    ++n;
    const std::string path = e.path().string();
    nlohmann::json j;
    ASSERT_NO_THROW(j = read_json(path)) << path << " is not valid JSON";
    ASSERT_TRUE(j.is_object()) << path;
    if (is_train_config(j)) {
      const auto r = sigma_cmd("train --print-config --config " + path);
      EXPECT_EQ(r.code, 0) << path << ": " << r.out;
    } else if (j.contains("corpus")) {
      EXPECT_NO_THROW(data::PrepareConfig::from_json(j, e.path().parent_path().string(), path)) << path;
    } else {  // a registry that a script completes with paths (bench/surgery_workflow.sh)
      ASSERT_TRUE(j.contains("domains")) << path << " is neither a train nor a data config";
      EXPECT_NO_THROW(DomainRegistry::from_json(j["domains"], path, DomainForm::Data)) << path;
    }
  }
  EXPECT_GT(n, 0);
}

TEST(Configs, EveryConfigTheDocsNameExists) {
  const std::regex name(R"(configs/[A-Za-z0-9_.-]+\.json)");
  std::set<std::string> named;
  std::vector<fs::path> docs{kRoot / "README.md"};
  for (const auto& e : fs::directory_iterator(kRoot / "docs")) docs.push_back(e.path());
  for (const fs::path& doc : docs) {
    std::ifstream in(doc);
    const std::string text((std::istreambuf_iterator<char>(in)), {});
    for (std::sregex_iterator it(text.begin(), text.end(), name), end; it != end; ++it)
      named.insert(it->str());
  }
  EXPECT_TRUE(named.count("configs/tiny.json"));
  for (const std::string& c : named) EXPECT_TRUE(fs::exists(kRoot / c)) << c << " is named in the docs";
}

// --set on a list key takes a bare word or comma list as users type it, as well as JSON; text
// that starts as JSON must still parse.
TEST(Configs, AListKeyTakesBareNamesOrJson) {
  sigma::Config cfg;
  cfg.load("", {"train.freeze=shared"});
  EXPECT_EQ(cfg.train.freeze, std::vector<std::string>{"shared"});
  cfg.load("", {"train.freeze=embeddings,experts"});
  EXPECT_EQ(cfg.train.freeze, (std::vector<std::string>{"embeddings", "experts"}));
  cfg.load("", {R"(train.freeze=["shared"])"});
  EXPECT_EQ(cfg.train.freeze, std::vector<std::string>{"shared"});
  try {
    cfg.load("", {R"(train.freeze=["shared")"});
    ADD_FAILURE() << "a broken JSON list was accepted";
  } catch (const sigma::Error& e) {
    EXPECT_NE(std::string(e.what()).find("--set train.freeze: value is not valid JSON"), std::string::npos) << e.what();
  }
}

TEST(Configs, TinyTrainsOnTheBuiltInData) {
  TempDir tmp("tiny");
  const auto r = sigma_cmd("train --quiet --config " + (kRoot / "configs/tiny.json").string() +
                           " --set train.steps=5 --set train.eval_rows=4 --out " + tmp / "a");
  ASSERT_EQ(r.code, 0) << r.out;
  for (const char* d : {"markov", "copy", "arith"}) EXPECT_NE(r.out.find(d), std::string::npos) << r.out;
}

}  // namespace
