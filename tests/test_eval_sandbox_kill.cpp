// `sigma eval` killed while it runs code samples (issue 37): by SIGINT (a terminal's Ctrl-C,
// sent to its process group), SIGTERM and SIGKILL, at several points after its first sample
// started, as root and as uid 1000. Each time the evaluator ends by that signal (with a message
// for SIGINT and SIGTERM), and within a bounded time no sample process (nor one it spawned with
// setsid), no supervisor, no sandbox folder and no memory cgroup is left.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/stat.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <thread>

#include "sandbox_test_util.h"
#include "test_util.h"

namespace {

using namespace sigma::testing;
using Clock = std::chrono::steady_clock;
using nlohmann::json;

int sandbox_entries(const fs::path& where, const std::string& prefix) {
  int n = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(where, ec))
    n += e.path().filename().string().rfind(prefix, 0) == 0;
  return n;
}

// The folder holding this process's memory cgroups (v1 here), or "" where there is none.
std::string memory_cgroup_parent() {
  std::ifstream in("/proc/self/cgroup");
  for (std::string l; std::getline(in, l);) {
    const size_t a = l.find(':'), b = l.find(':', a + 1);
    if (b != std::string::npos && l.substr(a + 1, b - a - 1) == "memory")
      return "/sys/fs/cgroup/memory" + l.substr(b + 1);
  }
  return "";
}

TEST(SandboxKill, NothingOutlivesAnInterruptedEvaluator) {
  TempDir d("kill");
  fs::permissions(d.path, fs::perms::owner_all | fs::perms::group_exec | fs::perms::others_exec |
                  fs::perms::group_read | fs::perms::others_read);
  const std::string marker = unique_sleep(77);
  // Eight samples of ~0.3 s each, each leaving two sleepers behind (one in its own session).
  const std::string completion = std::string(kSpawn) + "spawn(['/bin/sleep', '" + marker + "'], setsid=True)\n"
                                 "spawn(['/bin/sleep', '" + marker + "'])\nimport time\ntime.sleep(0.3)\n";
  const std::string gen = d / "gen.jsonl";
  {
    std::ofstream out(gen);
    for (int i = 0; i < 8; ++i)
      out << json{{"doc", {{"domain", "python"}, {"prompt", "# a sample that leaves sleepers\n"}, {"tests", "assert True"}, {"stop", json::array()}}},
                  {"generations", {completion}}}.dump() << "\n";
  }
  fs::permissions(gen, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read);
  const std::string cgroups = memory_cgroup_parent();
  double worst = 0;
  int runs = 0;
  for (uid_t uid : users()) {
    if (refused_here(uid, run_as(uid, "pass\n"))) continue;  // no sample would start
    for (int sig : {SIGINT, SIGTERM, SIGKILL})
      for (double delay : {0.0, 0.1, 0.35, 0.8}) {
        const std::string what = fmt::format("uid {} signal {} at +{} s", uid, sig, delay);
        TempDir tmp("kill-tmp");
        if (geteuid() == 0) (void)!chown(tmp.path.c_str(), uid, uid);
        const std::string out_path = d / fmt::format("out-{}.txt", runs++);
        const int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        ASSERT_GE(out, 0);
        const pid_t pid = fork();
        if (pid == 0) {
          setpgid(0, 0);  // its own group, as a shell's foreground job
          if (geteuid() == 0 && uid != 0 && (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0)) _exit(3);
          setenv("TMPDIR", tmp.str().c_str(), 1);
          dup2(out, 1), dup2(out, 2);
          execl(SIGMA_BINARY, SIGMA_BINARY, "eval", "--score-generations", gen.c_str(), "--timeout", "30", nullptr);
          _exit(127);
        }
        close(out);
        ASSERT_GT(pid, 0);
        setpgid(pid, pid);
        // Aim after the first sample started (its folder exists), then wait `delay`.
        const auto start = Clock::now();
        int status = 0;
        pid_t gone = 0;
        while (sandbox_entries(tmp.path, "sigma-sandbox-") == 0 && Clock::now() - start < std::chrono::seconds(30) &&
               (gone = waitpid(pid, &status, WNOHANG)) == 0)
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        ASSERT_EQ(gone, 0) << what << ": the evaluator ended before its first sample\n" << slurp(out_path);
        std::this_thread::sleep_for(std::chrono::duration<double>(delay));
        if (sig == SIGINT) kill(-pid, SIGINT);  // Ctrl-C reaches the whole foreground group
        else kill(pid, sig);
        const auto sent = Clock::now();
        while (waitpid(pid, &status, WNOHANG) == 0) {
          if (Clock::now() - sent > std::chrono::seconds(20)) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            ADD_FAILURE() << what << ": the evaluator did not end within 20 s of the signal";
            break;
          }
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        const auto ended = Clock::now();
        const std::string log = slurp(out_path);
        EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == sig) << what << ": status " << status << "\n" << log;
        if (sig == SIGINT) { EXPECT_NE(log.find("interrupted by SIGINT"), std::string::npos) << what << "\n" << log; }
        if (sig == SIGTERM) { EXPECT_NE(log.find("terminated by SIGTERM"), std::string::npos) << what << "\n" << log; }
        // Bounded: SIGKILL leaves the clean-up to the supervisor, which notices at once.
        const std::string me = fmt::format("sigma-sandbox-{}-", pid);
        auto left = [&] {
          return processes_with("sleep " + marker) + processes_with(gen) + sandbox_entries(tmp.path, "sigma-sandbox-") +
                 (cgroups.empty() ? 0 : sandbox_entries(cgroups, me));
        };
        while (left() > 0 && Clock::now() - ended < std::chrono::seconds(5))
          std::this_thread::sleep_for(std::chrono::milliseconds(1));
        worst = std::max(worst, std::chrono::duration<double>(Clock::now() - ended).count());
        EXPECT_EQ(processes_with("sleep " + marker), 0) << what << ": a sample's process survived";
        EXPECT_EQ(processes_with(gen), 0) << what << ": a supervisor survived";
        EXPECT_EQ(sandbox_entries(tmp.path, "sigma-sandbox-"), 0) << what << ": a sandbox folder is left";
        if (!cgroups.empty()) { EXPECT_EQ(sandbox_entries(cgroups, me), 0) << what << ": a memory cgroup is left"; }
      }
  }
  std::printf("%d kills; everything was gone at most %.3f s after the evaluator ended\n", runs, worst);
}

}  // namespace
