// Code samples run several at once (`sigma eval --jobs N`, eval::run_python_sandboxed_many):
// each sample keeps its own sandbox, limits and clean-up; the results are those of one sample
// after the other, in task order; hostile samples that sleep and leave processes behind never
// have more than N sandboxes at once, and nothing of them is left when the evaluator ends,
// normally or by SIGTERM.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

#include "sandbox_test_util.h"
#include "test_util.h"

namespace {

using namespace sigma::testing;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

int sandbox_entries(const fs::path& where) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(where, ec)) n += e.path().filename().string().rfind("sigma-sandbox-", 0) == 0;
  return n;
}

// Every kind of outcome, several times over, in an order where they finish out of order.
std::vector<std::string> mixed_programs() {
  const std::vector<std::string> kinds = {
      "import time\ntime.sleep(0.4)\nassert 1 + 1 == 2\n",           // passed (slow)
      "assert 1 + 1 == 3, 'wrong sum'\n",                            // failed
      "import sys\nsys.exit(0)\n",                                   // early_exit
      "while True:\n    pass\n",                                     // timeout
      "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\n",  // killed (signal 9)
      "print('fine')\n",                                             // passed (fast)
      "raise ValueError('bad value')\n",                             // failed
  };
  std::vector<std::string> out;
  for (int r = 0; r < 2; ++r) out.insert(out.end(), kinds.begin(), kinds.end());
  return out;
}

}  // namespace

TEST(SandboxJobs, ResultsAreTheSequentialOnesInOrder) {
  TempDir tmp("jobs-order");
  fs::permissions(tmp.path, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
  setenv("TMPDIR", tmp.str().c_str(), 1);
  SandboxLimits l = limits();
  l.seconds = 5;  // 3 s timed out honest samples at --jobs 4 under a load of 9 (other tests beside)
  const auto programs = mixed_programs();
  const auto one = sigma::eval::run_python_sandboxed_many(programs, l, 1);
  if (!one.empty() && one[0].why.find("no mount, PID and network namespace") != std::string::npos)
    GTEST_SKIP() << "no namespaces here: " << one[0].why;
  std::vector<size_t> order;
  const auto four = sigma::eval::run_python_sandboxed_many(
      programs, l, 4, [&](size_t i, const SandboxResult&) { order.push_back(i); });
  ASSERT_EQ(one.size(), programs.size());
  ASSERT_EQ(four.size(), programs.size());
  const char* expect[] = {"passed", "failed", "early_exit", "timeout", "killed", "passed", "failed"};
  for (size_t i = 0; i < programs.size(); ++i) {
    EXPECT_EQ(one[i].outcome, expect[i % 7]) << i << ": " << one[i].why;
    EXPECT_EQ(four[i].outcome, one[i].outcome) << i;
    EXPECT_EQ(four[i].why, one[i].why) << i;
    EXPECT_EQ(four[i].passed, one[i].passed) << i;
    EXPECT_EQ(four[i].exit_code, one[i].exit_code) << i;
    EXPECT_EQ(four[i].signal, one[i].signal) << i;
    EXPECT_EQ(four[i].protections, one[i].protections) << i;
  }
  // on_done saw every sample once, and not in task order (the slow first one ended later).
  std::vector<size_t> sorted = order;
  std::sort(sorted.begin(), sorted.end());
  for (size_t i = 0; i < sorted.size(); ++i) EXPECT_EQ(sorted[i], i);
  EXPECT_NE(order, sorted) << "four at once should finish out of order";
  EXPECT_EQ(sandbox_entries(tmp.path), 0);
  unsetenv("TMPDIR");
}

class SandboxJobsCli : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::permissions(d.path, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec |
                    fs::perms::group_read | fs::perms::others_read);
    fs::permissions(tmp.path, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec);
  }
  // `n` samples of ~`seconds` each that leave two sleepers behind (one in its own session).
  std::string hostile(int n, double seconds) {
    const std::string completion = std::string(kSpawn) + "spawn(['/bin/sleep', '" + marker + "'], setsid=True)\n"
                                   "spawn(['/bin/sleep', '" + marker + "'])\nimport time\ntime.sleep(" +
                                   std::to_string(seconds) + ")\n";
    const std::string gen = d / "hostile.jsonl";
    std::ofstream out(gen);
    for (int i = 0; i < n; ++i)
      out << json{{"doc", {{"domain", "python"}, {"prompt", "# sample " + std::to_string(i) + "\n"},
                           {"tests", i % 3 == 2 ? "assert False" : "assert True"}, {"stop", json::array()}}},
                  {"generations", {completion}}}.dump() << "\n";
    out.close();
    fs::permissions(gen, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read);
    return gen;
  }
  // Starts `sigma eval ARGS` with TMPDIR = tmp, output to `out`; returns its pid.
  pid_t start(const std::vector<std::string>& args, const std::string& out) {
    const pid_t pid = fork();
    if (pid == 0) {
      setenv("TMPDIR", tmp.str().c_str(), 1);
      const int fd = open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(fd, 1), dup2(fd, 2);
      std::vector<char*> argv = {const_cast<char*>(SIGMA_BINARY), const_cast<char*>("eval")};
      for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      execv(SIGMA_BINARY, argv.data());
      _exit(127);
    }
    return pid;
  }
  // Waits for `pid`, counting the sandbox folders that exist at once meanwhile.
  int wait_counting(pid_t pid, int& status, int& most) {
    most = 0;
    const auto t0 = Clock::now();
    while (waitpid(pid, &status, WNOHANG) == 0) {
      most = std::max(most, sandbox_entries(tmp.path));
      if (Clock::now() - t0 > std::chrono::seconds(120)) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        return -1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return 0;
  }
  // Nothing of the samples is left (a bounded wait: the supervisors clean up as they end).
  void expect_nothing_left(const std::string& what) {
    const auto t0 = Clock::now();
    while ((processes_with("sleep " + marker) + sandbox_entries(tmp.path)) > 0 &&
           Clock::now() - t0 < std::chrono::seconds(5))
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    EXPECT_EQ(processes_with("sleep " + marker), 0) << what << ": a sample's process survived";
    EXPECT_EQ(processes_with(d / "hostile.jsonl"), 0) << what << ": a supervisor survived";
    EXPECT_EQ(sandbox_entries(tmp.path), 0) << what << ": a sandbox folder is left";
  }
  TempDir d{"jobs-cli"}, tmp{"jobs-cli-tmp"};
  const std::string marker = unique_sleep(91);
};

TEST_F(SandboxJobsCli, NeverMoreThanJobsSandboxesAndNothingLeftAfter) {
  const std::string gen = hostile(12, 0.6);
  int status = 0, most = 0;
  const pid_t pid = start({"--score-generations", gen, "--jobs", "3", "--timeout", "30", "--json",
                           "--log-samples", d / "jobs3.log"}, d / "jobs3.out");
  ASSERT_EQ(wait_counting(pid, status, most), 0) << "the evaluator did not end within 120 s";
  const std::string log = slurp(d / "jobs3.out");
  if (log.find("no mount, PID and network namespace") != std::string::npos) GTEST_SKIP() << "no namespaces here";
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << log;
  EXPECT_LE(most, 3) << "more sandboxes at once than --jobs 3";
  EXPECT_GE(most, 2) << "the samples did not run side by side";
  expect_nothing_left("--jobs 3");
  const json j = json::parse(log.substr(log.rfind("\n{") + 1));
  EXPECT_EQ(j["settings"]["jobs"], 3);
  EXPECT_EQ(j["code"]["passed"], 8) << j.dump();  // every third sample's test fails
  // The same scores and the same per-sample outcomes one at a time.
  const pid_t seq = start({"--score-generations", gen, "--jobs", "1", "--timeout", "30", "--json",
                           "--log-samples", d / "jobs1.log"}, d / "jobs1.out");
  ASSERT_EQ(wait_counting(seq, status, most), 0);
  EXPECT_LE(most, 1);
  const std::string log1 = slurp(d / "jobs1.out");
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << log1;
  const json j1 = json::parse(log1.substr(log1.rfind("\n{") + 1));
  EXPECT_EQ(j1["code"], j["code"]);
  EXPECT_EQ(slurp(d / "jobs1.log"), slurp(d / "jobs3.log"));
  expect_nothing_left("--jobs 1");
}

TEST_F(SandboxJobsCli, SigtermWhileSeveralRunLeavesNothing) {
  const std::string gen = hostile(12, 5);
  const pid_t pid = start({"--score-generations", gen, "--jobs", "4", "--timeout", "30"}, d / "term.out");
  const auto t0 = Clock::now();
  while (sandbox_entries(tmp.path) < 3 && Clock::now() - t0 < std::chrono::seconds(60))
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the samples are sleeping now
  const std::string early = slurp(d / "term.out");
  if (early.find("no mount, PID and network namespace") != std::string::npos) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    GTEST_SKIP() << "no namespaces here";
  }
  EXPECT_GE(sandbox_entries(tmp.path), 3) << early;
  kill(pid, SIGTERM);
  int status = 0, most = 0;
  ASSERT_EQ(wait_counting(pid, status, most), 0);
  const std::string log = slurp(d / "term.out");
  EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGTERM) << log;
  EXPECT_NE(log.find("terminated by SIGTERM"), std::string::npos) << log;
  EXPECT_LE(most, 4);
  expect_nothing_left("SIGTERM with 4 at once");
}
