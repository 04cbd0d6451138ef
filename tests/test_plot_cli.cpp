// sigma plot: a short run's figures exist and hold what they claim (every domain in the loss
// legend, one expert-load heatmap per RRE block), and bad run directories are clear errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "test_util.h"

using namespace sigma::testing;
namespace fs = std::filesystem;

namespace {

TEST(Plot, WritesLossLrThroughputAndAHeatmapPerRreBlock) {
  TempDir dir("plot");
  // The default model: one shared block under two RRE blocks (1 and 2), three synthetic domains.
  auto r = sigma_cmd("train --quiet --set train.steps=12 --set train.log_every=3 --set train.eval_rows=8 "
                     "--set model.d_model=32 --set model.heads=2 --out " + dir / "run");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("plot " + dir / "run");
  ASSERT_EQ(r.code, 0) << r.out;
  const std::string loss = slurp(dir / "run/plots/loss.svg");
  ASSERT_FALSE(loss.empty()) << r.out;
  EXPECT_NE(loss.find("<svg"), std::string::npos);
  const std::string summary = slurp(dir / "run/summary.json");
  for (const auto& [d, v] : nlohmann::json::parse(summary)["domains"].items()) {
    EXPECT_NE(loss.find(d + " (train)"), std::string::npos) << d;
    EXPECT_NE(loss.find(d + " (held-out)"), std::string::npos) << d;
  }
  for (const char* f : {"lr.svg", "tokens_per_s.svg", "expert_load_block1.svg", "expert_load_block2.svg"})
    EXPECT_NE(slurp(dir / ("run/plots/" + std::string(f))).find("<svg"), std::string::npos) << f;
  EXPECT_FALSE(fs::exists(dir / "run/plots/expert_load_block0.svg"));  // the shared block
  // The heatmap's data: one row per logging window (4), shares that sum to 1 per group.
  std::ifstream heat(dir / "run/plots/expert_load_block1.dat");
  int rows = 0;
  for (std::string line; std::getline(heat, line);) ++rows;
  EXPECT_EQ(rows, 4);
  r = sigma_cmd("plot " + dir / "run --format png --out " + dir / "png");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(slurp(dir / "png/loss.png").substr(1, 3), "PNG");
}

// train.eval_every's held-out losses are plotted against their steps beside the training loss
// (issue 39: only the end's point was): loss.dat's second block holds one row per evaluation,
// each domain's loss as metrics.jsonl has it, and loss.gp plots it per domain.
TEST(Plot, HeldOutEvaluationsAreALinePerDomain) {
  TempDir dir("plot-held");
  auto r = sigma_cmd("train --quiet --set train.steps=12 --set train.log_every=3 --set train.eval_every=4 "
                     "--set train.eval_rows=8 --set model.d_model=32 --set model.heads=2 --out " + dir / "run");
  ASSERT_EQ(r.code, 0) << r.out;
  r = sigma_cmd("plot " + dir / "run");
  ASSERT_EQ(r.code, 0) << r.out;
  std::vector<std::string> expected;  // "step loss loss loss", domains in name order
  for (const auto& j : read_json_lines(dir / "run/metrics.jsonl")) {
    if (!j.contains("held_out")) continue;
    std::string row = fmt::format("{}", j["step"].get<int64_t>());
    for (const char* d : {"arith", "copy", "markov"}) row += fmt::format(" {:.9g}", j["held_out"][d].get<double>());
    expected.push_back(row);
  }
  ASSERT_EQ(expected.size(), 3u);  // steps 4, 8, 12
  const std::string dat = slurp(dir / "run/plots/loss.dat");
  const size_t block = dat.find("\n\n\n");
  ASSERT_NE(block, std::string::npos) << dat;
  std::vector<std::string> rows;
  std::istringstream held(dat.substr(block + 3));
  for (std::string line; std::getline(held, line);) rows.push_back(line);
  EXPECT_EQ(rows, expected) << dat;
  const std::string gp = slurp(dir / "run/plots/loss.gp");
  for (int col : {2, 3, 4}) EXPECT_NE(gp.find(fmt::format("index 1 using 1:{} with linespoints", col)), std::string::npos) << gp;
  EXPECT_NE(slurp(dir / "run/plots/loss.svg").find("markov (held-out)"), std::string::npos);
}

TEST(Plot, BadRunDirectoriesAreClearErrors) {
  TempDir dir("plot-bad");
  auto r = sigma_cmd("plot " + dir / "nothing");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("nothing/metrics.jsonl"), std::string::npos) << r.out;
  fs::create_directories(dir / "run");
  std::ofstream(dir / "run/metrics.jsonl") << "{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\n";
  r = sigma_cmd("plot " + dir / "run");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("metrics.jsonl:2: not a metrics record"), std::string::npos) << r.out;
}

}  // namespace
