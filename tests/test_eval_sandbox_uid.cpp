// Each sample's process limit is its own (src/eval/sandbox_uid.cpp): as root a sample runs as a
// uid and gid of its own, unused by any account and by any other sample running at once; as
// another user it runs in its own user namespace. RLIMIT_NPROC is counted per user, so when
// every sample ran as nobody, a fork bomb filling its limit in one evaluator made a sample of
// another evaluator fail ("Cannot fork", or python3 itself could not start). Here evaluator A
// fills its limit and holds it while evaluator B's sample starts ten processes: B must pass,
// and nothing of either (process, folder) is left, whether A ends normally or is SIGKILLed.
#include <gtest/gtest.h>
#include <pwd.h>
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <functional>
#include <regex>
#include <set>
#include <thread>

#include "sandbox_test_util.h"
#include "test_util.h"

namespace {

using namespace sigma::testing;
using Clock = std::chrono::steady_clock;

// Waits (at most `seconds`) until `done` holds; returns whether it did.
bool wait_until(double seconds, const std::function<bool()>& done) {
  const auto t0 = Clock::now();
  while (!done()) {
    if (Clock::now() - t0 > std::chrono::duration<double>(seconds)) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return true;
}

// Processes whose real uid is `uid` (what RLIMIT_NPROC counts).
int processes_of_uid(uid_t uid) {
  int n = 0;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(e.path() / "status");
    for (std::string line; std::getline(in, line);)
      if (line.rfind("Uid:", 0) == 0) {
        n += std::stoul(line.substr(4)) == uid;
        break;
      }
  }
  return n;
}

int folder_entries(const fs::path& p) {
  int n = 0;
  std::error_code ec;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(p, ec)) ++n;
  return n;
}

// Evaluator A's exit status when the sandbox refused its sample (refused_here's case).
constexpr int kARefused = 5;

// Forks evaluator A: drops to `uid`, runs `program` in the sandbox with TMPDIR `tmp`.
pid_t start_evaluator(uid_t uid, const std::string& program, const SandboxLimits& l, const fs::path& tmp) {
  const pid_t pid = fork();
  if (pid == 0) {
    if (geteuid() == 0 && (setgroups(0, nullptr) != 0 || setgid(uid) != 0 || setuid(uid) != 0)) _exit(3);
    setenv("TMPDIR", tmp.c_str(), 1);
    try {
      const SandboxResult r = run_python_sandboxed(program, l);
      std::printf("evaluator A: %s: %s\n", r.outcome.c_str(), r.why.c_str());
      std::fflush(stdout);  // _exit does not flush
      _exit(is_refusal(r) ? kARefused : 0);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "evaluator A: %s\n", e.what());
      _exit(4);
    }
  }
  return pid;
}

// Fills its process limit with sleepers, then swaps one for a "full" marker and holds them for
// 12 s (B, started when the marker appears, needs 1-2 s on a loaded machine).
std::string bomb(const std::string& sleeper, const std::string& full) {
  return std::string(kSpawn) +
         "pids = []\ntry:\n    for _ in range(300):\n        pids.append(spawn(['/bin/sleep', '" + sleeper + "']))\n"
         "except OSError as e:\n    print('limit after', len(pids), e)\n"
         "os.kill(pids[-1], 9)\nos.waitpid(pids[-1], 0)\n"
         "spawn(['/bin/sleep', '" + full + "'])\n"
         "import time\ntime.sleep(12)\n";
}

// Starts ten processes, ends them, then fails on purpose to report its uid and gid.
std::string forker(const std::string& sleeper) {
  return std::string(kSpawn) +
         "pids = [spawn(['/bin/sleep', '" + sleeper + "']) for _ in range(10)]\n"
         "for p in pids:\n    os.kill(p, 9)\n    os.waitpid(p, 0)\n"
         "assert False, f'forked 10 as uid {os.getuid()} gid {os.getgid()}'\n";
}

TEST(SandboxUid, AForkBombInOneEvaluatorLeavesAnotherItsForks) {
  for (uid_t uid : users())
    for (bool kill_a : {false, true}) {
      SCOPED_TRACE(fmt::format("uid {} kill_a {}", uid, kill_a));
      const std::string sleeper = unique_sleep(int(uid) + 20 + kill_a), full = unique_sleep(int(uid) + 30 + kill_a),
                        other = unique_sleep(int(uid) + 40 + kill_a);
      TempDir tmp_a("uid-a");
      if (geteuid() == 0) {
        ASSERT_EQ(chown(tmp_a.path.c_str(), uid, uid), 0);
      }
      SandboxLimits l = limits();
      l.seconds = 60;
      const pid_t a = start_evaluator(uid, bomb(sleeper, full), l, tmp_a.path);
      struct Reap {  // A never outlives a failed assertion
        pid_t pid;
        ~Reap() {
          if (pid > 0 && waitpid(pid, nullptr, WNOHANG) == 0) kill(pid, SIGKILL), waitpid(pid, nullptr, 0);
        }
      } reap_a{a};
      int a_status = 0;
      const bool filled = wait_until(60, [&] { return processes_with("sleep " + full) > 0 || waitpid(a, &a_status, WNOHANG) == a; });
      if (filled && processes_with("sleep " + full) == 0 && WIFEXITED(a_status) && WEXITSTATUS(a_status) == kARefused) {
        reap_a.pid = 0;  // this user gets no namespaces here (a chroot): nothing to check but that
        EXPECT_EQ(folder_entries(tmp_a.path), 0) << "evaluator A's refused sample left folders";
        continue;
      }
      if (!filled || processes_with("sleep " + full) == 0)
        FAIL() << "evaluator A's sample did not fill its process limit within 60 s (or ended first)";
      EXPECT_GE(processes_with("sleep " + sleeper), 50) << "A's sample holds its limit";
      const Outcome b = run_as(uid, forker(other));
      if (refused_here(uid, b)) continue;
      ASSERT_TRUE(b.evaluator_ok);
      EXPECT_EQ(b.r.outcome, "failed") << b.r.why;
      EXPECT_NE(b.r.why.find("forked 10 as uid"), std::string::npos)
          << "B's sample could not fork beside A's fork bomb: " << b.r.why;
      EXPECT_EQ(b.leftover_dirs, 0);
      if (uid == 0) {  // its own user: not nobody, not root, not an account, in the range
        std::smatch m;
        ASSERT_TRUE(std::regex_search(b.r.why, m, std::regex("uid (\\d+) gid (\\d+)"))) << b.r.why;
        const uint64_t id = std::stoull(m[1]);
        EXPECT_EQ(m[1], m[2]);
        EXPECT_GE(id, 0x70000000u);
        EXPECT_LT(id, 0x71000000u);
        EXPECT_EQ(getpwuid(uid_t(id)), nullptr);
        EXPECT_EQ(processes_of_uid(uid_t(id)), 0) << "a process of the sample's uid is left";
      }
      if (kill_a) kill(a, SIGKILL);  // A's supervisor must still clean up
      int status = 0;
      ASSERT_TRUE(wait_until(90, [&] { return waitpid(a, &status, WNOHANG) == a; })) << "evaluator A did not end";
      reap_a.pid = 0;
      if (!kill_a) {
        EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
      }
      EXPECT_TRUE(wait_until(10, [&] {
        return processes_with("sleep " + sleeper) + processes_with("sleep " + full) + processes_with("sleep " + other) +
                   folder_entries(tmp_a.path) == 0;
      })) << "left: " << processes_with("sleep " + sleeper) << " sleepers, " << folder_entries(tmp_a.path) << " folders";
    }
}

// Samples at once (one evaluator, --jobs 4) each get a different uid; one after the other the
// ids are released (no process of any of them is left).
TEST(SandboxUid, SamplesAtOnceHaveDifferentUsers) {
  if (geteuid() != 0) GTEST_SKIP() << "only root switches the sample to a user of its own";
  const std::string program = "import os, time\ntime.sleep(1)\nassert False, f'uid {os.getuid()}'\n";
  SandboxLimits l = limits();
  const auto results = sigma::eval::run_python_sandboxed_many(std::vector<std::string>(4, program), l, 4);
  std::set<std::string> ids;
  for (const SandboxResult& r : results) {
    EXPECT_NE(r.protections.find("own-user"), std::string::npos) << r.protections;
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.why, m, std::regex("uid (\\d+)"))) << r.why;
    ids.insert(m[1]);
    EXPECT_EQ(processes_of_uid(uid_t(std::stoull(m[1]))), 0);
  }
  EXPECT_EQ(ids.size(), 4u) << "two samples at once shared a uid";
}

}  // namespace
