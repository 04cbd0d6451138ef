// Java code samples (issue 39 item 11) in the same sandbox as Python's: compiled and run by the
// JDK's java (SigmaGuard.java: javax.tools in the same JVM, then Main.main, then the sentinel),
// with the sandbox's limits. Honest programs pass; wrong ones, compile errors and early exits
// fail with their reason; hostile ones (many processes and threads, writes and reads outside,
// sleeping forever, allocating without bound) are bounded, fail, and leave nothing. The tests
// need a JDK (scripts/install-deps.sh installs default-jdk-headless): without one they fail.
#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "sandbox_test_util.h"
#include "test_util.h"

namespace {

using namespace sigma::testing;
using sigma::eval::run_sandboxed_many;
using sigma::eval::SandboxLanguage;
using sigma::eval::SandboxProgram;

// A Main.java whose main runs `body` (with java.util.* and java.nio.file.* imported).
std::string java_main(const std::string& body, const std::string& more = "") {
  return "import java.util.*;\nimport java.nio.file.*;\nimport java.io.*;\n" + more +
         "public class Main {\n    public static void main(String[] args) throws Exception {\n" + body + "\n    }\n}\n";
}

std::vector<SandboxResult> run_java(const std::vector<std::string>& programs, const SandboxLimits& l, int jobs = 2) {
  std::vector<SandboxProgram> p;
  for (const std::string& s : programs) p.push_back({SandboxLanguage::Java, s});
  return run_sandboxed_many(p, l, jobs);
}

bool refused(const SandboxResult& r) {
  return r.outcome == "error" && r.why.find("no mount, PID and network namespace") != std::string::npos;
}

TEST(SandboxJava, PassesFailsAndEarlyExitsAreTold) {
  const std::string solution =
      "class Solution {\n    public int add(int a, int b) {\n        return a + b;\n    }\n}\n";
  const std::vector<std::string> programs = {
      java_main("        assert new Solution().add(2, 3) == 5;", solution),                         // passed
      java_main("        assert new Solution().add(2, 3) == 6 : \"2 + 3\";", solution),             // failed
      java_main("        int x = \"not an int\";"),                                                // compile error
      java_main("        System.exit(0);\n        // the tests would be here"),                     // early exit
      java_main("        Runtime.getRuntime().halt(0);"),                                          // early exit
      java_main("        throw new IllegalStateException(\"boom\");"),                             // failed
      java_main("        System.out.println(\"hello\");"),                                         // passed
  };
  const auto r = run_java(programs, limits());
  if (refused(r[0])) GTEST_SKIP() << r[0].why;
  EXPECT_EQ(r[0].outcome, "passed") << r[0].why;
  EXPECT_TRUE(r[0].finished);
  EXPECT_NE(r[0].protections.find("sentinel"), std::string::npos) << r[0].protections;
  EXPECT_EQ(r[0].protections.find("audit-hook"), std::string::npos) << "Java has no audit hook: " << r[0].protections;
  EXPECT_EQ(r[1].outcome, "failed");
  EXPECT_NE(r[1].why.find("java.lang.AssertionError: 2 + 3"), std::string::npos) << r[1].why;
  EXPECT_EQ(r[2].outcome, "failed");
  EXPECT_NE(r[2].why.find("compile error: Main.java:6: incompatible types"), std::string::npos) << r[2].why;
  EXPECT_EQ(r[3].outcome, "early_exit") << r[3].why;
  EXPECT_EQ(r[4].outcome, "early_exit") << r[4].why;
  EXPECT_EQ(r[5].outcome, "failed");
  EXPECT_NE(r[5].why.find("java.lang.IllegalStateException: boom"), std::string::npos) << r[5].why;
  EXPECT_EQ(r[6].outcome, "passed") << r[6].why;
}

// The JVM needs ~100 MiB of its own besides a heap: a smaller limit is refused, saying so,
// before anything runs.
TEST(SandboxJava, ATooSmallMemoryLimitIsAClearError) {
  SandboxLimits l = limits();
  l.memory_bytes = 256ull << 20;
  try {
    run_java({java_main("")}, l, 1);
    ADD_FAILURE() << "a 256 MiB limit was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("a Java sample needs a memory limit of at least 320 MiB"), std::string::npos)
        << e.what();
  }
}

// Each hostile sample, as root and as uid 1000, in a forked child that drops to it.
class SandboxJavaHostile : public ::testing::Test {
 protected:
  // Runs the Java `program` as `uid` (sandbox_test_util.h's run_as_with).
  Outcome as(uid_t uid, const std::string& program, const SandboxLimits& l = limits()) {
    return run_as_with(uid, [&] { return run_java({program}, l, 1)[0]; });
  }
};

TEST_F(SandboxJavaHostile, ManyProcessesAndThreadsAreBoundedAndNoneIsLeft) {
  for (uid_t uid : users()) {
    const std::string m = unique_sleep(int(uid) + 50);
    const std::string procs = java_main(
        "        int n = 0;\n"
        "        try {\n"
        "            for (int i = 0; i < 300; ++i) { new ProcessBuilder(\"/bin/sleep\", \"" + m + "\").inheritIO().start(); ++n; }\n"
        "        } finally { System.out.println(\"started \" + n); }");
    Outcome o = as(uid, procs);
    if (refused_here(uid, o)) continue;
    ASSERT_TRUE(o.evaluator_ok) << "uid " << uid;
    EXPECT_EQ(o.r.outcome, "failed") << "uid " << uid << ": " << o.r.why;
    // RLIMIT_NPROC ends it: at a fork, or at the reaper thread each Process starts.
    EXPECT_TRUE(o.r.why.find("Resource temporarily unavailable") != std::string::npos ||
                o.r.why.find("unable to create native thread") != std::string::npos) << o.r.why;
    EXPECT_EQ(processes_with("sleep " + m), 0) << "uid " << uid;
    EXPECT_EQ(o.leftover_dirs, 0);
    const std::string threads = java_main(
        "        for (int i = 0; i < 5000; ++i) {\n"
        "            Thread th = new Thread(() -> { try { Thread.sleep(100000); } catch (InterruptedException e) {} });\n"
        "            th.setDaemon(true);\n            th.start();\n        }");
    o = as(uid, threads);
    ASSERT_TRUE(o.evaluator_ok) << "uid " << uid;
    EXPECT_EQ(o.r.outcome, "failed") << "uid " << uid << ": " << o.r.why;
    EXPECT_NE(o.r.why.find("unable to create native thread"), std::string::npos) << o.r.why;
    EXPECT_EQ(o.leftover_dirs, 0);
  }
}

TEST_F(SandboxJavaHostile, WritesAndReadsOutsideFail) {
  TempDir dir("java-outside");
  fs::permissions(dir.path, fs::perms::all | fs::perms::sticky_bit);
  const std::string secret = dir / "secret.txt";
  { std::ofstream(secret) << "host data\n"; }
  fs::permissions(secret, fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read | fs::perms::others_read);
  const std::string target = dir / "written.txt";
  for (uid_t uid : users()) {
    for (const std::string& body : std::vector<std::string>{
          "        Files.writeString(Paths.get(\"" + target + "\"), \"pwned\");",
          "        new FileOutputStream(\"/usr/pwned\").write(1);",
          "        Files.writeString(Paths.get(\"/etc/pwned\"), \"x\");",
          "        System.out.println(Files.readString(Paths.get(\"" + secret + "\")));",
          "        System.out.println(Files.readString(Paths.get(\"/etc/shadow\")));"}) {
      const Outcome o = as(uid, java_main(body));
      if (refused_here(uid, o)) break;
      ASSERT_TRUE(o.evaluator_ok) << "uid " << uid;
      EXPECT_EQ(o.r.outcome, "failed") << "uid " << uid << ": " << body << ": " << o.r.why;
      EXPECT_TRUE(o.r.why.find("NoSuchFileException") != std::string::npos ||
                  o.r.why.find("FileSystemException") != std::string::npos ||
                  o.r.why.find("AccessDeniedException") != std::string::npos ||
                  o.r.why.find("FileNotFoundException") != std::string::npos)
          << "uid " << uid << ": " << body << ": " << o.r.why;
      EXPECT_FALSE(fs::exists(target));
      EXPECT_FALSE(fs::exists("/usr/pwned"));
      EXPECT_FALSE(fs::exists("/etc/pwned"));
      EXPECT_EQ(o.leftover_dirs, 0);
    }
  }
}

TEST_F(SandboxJavaHostile, SleepingForeverTimesOutAndAllocatingWithoutBoundFails) {
  for (uid_t uid : users()) {
    SandboxLimits l = limits();
    l.seconds = 8;
    Outcome o = as(uid, java_main("        Thread.sleep(Long.MAX_VALUE);"), l);
    if (refused_here(uid, o)) continue;
    ASSERT_TRUE(o.evaluator_ok) << "uid " << uid;
    EXPECT_EQ(o.r.outcome, "timeout") << "uid " << uid << ": " << o.r.why;
    EXPECT_EQ(o.leftover_dirs, 0);
    // The heap is the limit less the JVM's own 256 MiB: 256 MiB of 512.
    o = as(uid, java_main("        List<long[]> keep = new ArrayList<>();\n"
                          "        while (true) keep.add(new long[1 << 20]);"));
    ASSERT_TRUE(o.evaluator_ok) << "uid " << uid;
    EXPECT_EQ(o.r.outcome, "failed") << "uid " << uid << ": " << o.r.why;
    EXPECT_NE(o.r.why.find("OutOfMemoryError: Java heap space"), std::string::npos) << o.r.why;
    EXPECT_EQ(o.leftover_dirs, 0);
  }
}

}  // namespace
