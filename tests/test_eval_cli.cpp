// sigma eval without prepared shards: a checkpoint of the built-in synthetic data is scored on
// that data's held-out stream, with the run's own defaults, beside each domain's optimum.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "test_util.h"

using namespace sigma::testing;

namespace {

const std::string kTiny =
    "--set model.d_model=32 --set model.layers=2 --set model.heads=2 --set model.context=16 "
    "--set train.batch=6 --set train.log_every=5 --set train.eval_rows=12 --set optim.warmup=3 ";

// sigma with its stderr dropped: stdout alone (e.g. --json, without the notes on stderr).
CmdResult sigma_stdout(const std::string& args) {
  std::string cmd = "(";
  cmd += SIGMA_BINARY;
  cmd += " " + args + " 2>/dev/null)";
  return run_cmd(cmd);
}

TEST(EvalCli, WithoutDataScoresTheSyntheticHeldOutStreamAsTrainingEndedIt) {
  TempDir tmp("eval");
  auto r = sigma_cmd("train --quiet " + kTiny + "--set train.steps=20 --out " + tmp / "a");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("eval --ckpt " + tmp / "a/checkpoints --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  const auto s = read_json(tmp / "a/summary.json");
  EXPECT_EQ(j["data"], "synthetic");
  ASSERT_EQ(j["domains"].size(), 3u) << r.out;
  for (const char* d : {"markov", "copy", "arith"}) {
    const auto& e = j["domains"][d];
    const auto& t = s["domains"][d];
    // Same rows, batch and model as the end of the run: the loss the run reported.
    EXPECT_NEAR(e["loss"].get<double>(), t["loss"].get<double>(), 1e-6) << d;
    EXPECT_EQ(e["tokens"], t["tokens"]) << d;
    EXPECT_EQ(e["optimum"].get<double>(), t["optimum"].get<double>()) << d;
    EXPECT_TRUE(e["bits_per_byte"].is_null()) << d;  // token ids of no tokenizer: no bytes
    EXPECT_TRUE(e["bytes"].is_null()) << d;
  }
  r = sigma_cmd("eval --ckpt " + tmp / "a/checkpoints");  // the table shows the optimum and gap
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("optimum"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("gap"), std::string::npos) << r.out;
  for (const char* d : {"markov", "copy", "arith"}) EXPECT_NE(r.out.find(d), std::string::npos);
  // --rows and --batch still apply.
  r = sigma_cmd("eval --ckpt " + tmp / "a/checkpoints --rows 5 --batch 4 --json");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(nlohmann::json::parse(r.out)["domains"]["copy"]["tokens"], 5 * 16);
}

// An extract of the synthetic model evaluated on its parent's data: the other two domains are
// skipped with a reason, and --domains must name domains the extract knows.
TEST(EvalCli, ExtractOnTheSyntheticDataSkipsTheDomainsItDoesNotKnow) {
  TempDir tmp("eval");
  auto r = sigma_cmd("train --quiet " + kTiny + "--set train.steps=4 --out " + tmp / "a");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("extract --ckpt " + tmp / "a/checkpoints --domain copy --out " + tmp / "copy");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_stdout("eval --ckpt " + tmp / "copy --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["domains"].size(), 1u) << r.out;
  EXPECT_TRUE(j["domains"]["copy"]["optimum"].is_number()) << r.out;
  EXPECT_EQ(j["skipped"].size(), 2u) << r.out;
  EXPECT_TRUE(j["skipped"].contains("markov") && j["skipped"].contains("arith")) << r.out;
  r = sigma_cmd("eval --ckpt " + tmp / "copy");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("skipped markov (not a domain of the model), arith (not a domain of the "
                       "model); evaluating copy"), std::string::npos) << r.out;
  r = sigma_cmd("eval --ckpt " + tmp / "copy --domains arith");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("no domain 'arith'"), std::string::npos) << r.out;
  r = sigma_cmd("eval --ckpt " + tmp / "a/checkpoints --domains arith,copy --json");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto two = nlohmann::json::parse(r.out);
  EXPECT_EQ(two["domains"].size(), 2u) << r.out;
  EXPECT_FALSE(two["domains"].contains("markov")) << r.out;
}

}  // namespace
