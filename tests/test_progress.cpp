// Progress lines of the long steps (issue 39 trap 8): `sigma tokenizer train` shows its reading
// and its merges with an ETA; quick runs and non-terminal runs within the interval stay quiet.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "cli_util.h"

using namespace sigma::testing;

TEST(Progress, TokenizerTrainShowsReadingAndMergesWithAnEta) {
  TempDir tmp("progress");
  {
    std::ofstream c(tmp / "c.jsonl");
    for (int i = 0; i < 2000; ++i)
      c << nlohmann::json{{"domain", "p"}, {"text", "the cat " + std::to_string(i) + " sat on the mat"}}.dump() << "\n";
  }
  const std::string cmd = "tokenizer train --corpus " + tmp / "c.jsonl" + " --vocab-size 400 --out " + tmp / "t.json";
  // Not a terminal: a line every SIGMA_PROGRESS_SECONDS (10 by default; 0 = every update).
  auto r = run_cmd("SIGMA_PROGRESS_SECONDS=0 " + std::string(SIGMA_BINARY) + " " + cmd);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("tokenizer train: reading: "), std::string::npos) << r.out.substr(0, 2000);
  EXPECT_NE(r.out.find(" KiB ("), std::string::npos);
  EXPECT_NE(r.out.find("tokenizer train: merges: 100/"), std::string::npos);
  EXPECT_NE(r.out.find("| ETA 0m"), std::string::npos);
  r = sigma_cmd(cmd);  // well under 10 s: nothing but the summary lines
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("ETA"), std::string::npos) << r.out;
}
