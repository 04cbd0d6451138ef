// Java code tasks (issue 39 item 11) through `sigma eval` as a user runs them: the example task
// file (examples/paper-workflow/code-tasks-java.jsonl: two functions of commons-io's
// FilenameUtils from ../shared/data's Java corpus and three problems written for Sigma) and
// its saved generations (code-tasks-java.check.jsonl: per problem a right completion that runs
// on past the stop, a wrong one and one that exits before the tests) scored by
// `--score-generations`: pass@k as for Python, each sample compiled and run by the JDK in the
// sandbox. Needs a JDK (scripts/install-deps.sh installs default-jdk-headless).
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_util.h"
#include "eval/tasks.h"
#include "test_util.h"

namespace {

using namespace sigma::testing;
using nlohmann::json;

const std::string kTasks = std::string(SIGMA_SOURCE_DIR) + "/examples/paper-workflow/code-tasks-java.jsonl";
const std::string kCheck = std::string(SIGMA_SOURCE_DIR) + "/examples/paper-workflow/code-tasks-java.check.jsonl";

json last_json_of(const std::string& out) { return json::parse(out.substr(out.rfind("\n{") + 1)); }

TEST(JavaTasks, TheExampleFileReadsAsJavaCodeItems) {
  const auto items = sigma::eval::read_task_file(kTasks, {"python", "java"});
  ASSERT_EQ(items.size(), 5u);
  for (const auto& it : items) {
    EXPECT_EQ(it.kind, sigma::eval::TaskKind::Code);
    EXPECT_EQ(it.language, sigma::eval::SandboxLanguage::Java);
    EXPECT_EQ(it.stop, sigma::eval::kJavaCodeStops);
    EXPECT_EQ(it.tests.rfind("    }\n}\n", 0), 0u) << "the tests close the method and class first";
  }
  // The domain "java" alone makes an item Java; "language" says it for any domain; others fail.
  const json base = {{"domain", "java"}, {"prompt", "class Solution {\n"}, {"tests", "}\n"}};
  EXPECT_EQ(sigma::eval::parse_task_item(base, "t.jsonl", 1, {}).language, sigma::eval::SandboxLanguage::Java);
  json py = base;
  py["domain"] = "python";
  EXPECT_EQ(sigma::eval::parse_task_item(py, "t.jsonl", 2, {}).language, sigma::eval::SandboxLanguage::Python);
  py["language"] = "java";
  EXPECT_EQ(sigma::eval::parse_task_item(py, "t.jsonl", 3, {}).language, sigma::eval::SandboxLanguage::Java);
  py["language"] = "kotlin";
  try {
    sigma::eval::parse_task_item(py, "t.jsonl", 4, {});
    ADD_FAILURE() << "\"language\": \"kotlin\" was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("t.jsonl:4: \"language\" must be \"python\" or \"java\""), std::string::npos) << e.what();
  }
}

TEST(JavaTasks, SavedGenerationsScoreThroughSigmaEval) {
  TempDir d("java-tasks");
  const std::string log = d / "log.jsonl";
  const auto r = sigma_cmd("eval --score-generations " + kCheck + " --k 1,3 --timeout 60 --jobs 2 --json --log-samples " + log);
  if (r.out.find("no mount, PID and network namespace") != std::string::npos) GTEST_SKIP() << "no namespaces here";
  ASSERT_EQ(r.code, 0) << r.out;
  const json j = last_json_of(r.out);
  const json code = j["code"];
  EXPECT_EQ(code["items"], 5);
  EXPECT_EQ(code["samples"], 3);
  EXPECT_EQ(code["passed"], 5) << code.dump();
  EXPECT_EQ(code["failures"], json({{"early_exit", 5}, {"failed", 5}})) << code.dump();
  EXPECT_DOUBLE_EQ(code["pass@1"].get<double>(), 1.0 / 3);
  EXPECT_DOUBLE_EQ(code["pass@3"].get<double>(), 1.0);
  EXPECT_EQ(code["sandbox"].get<std::string>().find("audit-hook"), std::string::npos) << code["sandbox"];
  std::ifstream in(log);
  int lines = 0;
  for (std::string line; std::getline(in, line);) {
    const json e = json::parse(line);
    if (!e.contains("outcomes")) continue;
    ++lines;
    ASSERT_EQ(e["outcomes"].size(), 3u);
    EXPECT_EQ(e["outcomes"][0]["outcome"], "passed") << e["outcomes"][0];
    EXPECT_EQ(e["outcomes"][1]["outcome"], "failed");
    EXPECT_NE(e["outcomes"][1]["why"].get<std::string>().find("AssertionError"), std::string::npos) << e["outcomes"][1];
    EXPECT_EQ(e["outcomes"][2]["outcome"], "early_exit");
    // Cut at the stop: what ran is the method's body, not the text the model went on with.
    EXPECT_EQ(e["generations"][0].get<std::string>().find("more text after the stop"), std::string::npos);
  }
  EXPECT_EQ(lines, 5);
}

}  // namespace
