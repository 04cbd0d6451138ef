// Internal to the sandbox (sandbox.cpp, sandbox_child.cpp, sandbox_cgroup.cpp): the plan the
// evaluator prepares before fork, the records the sandbox's processes report on a pipe, and the
// per-sample memory cgroup. After fork the children make only system calls (the evaluator has
// OpenMP threads, so they may not allocate): every string they use is prepared here.
#pragma once
#include <sys/types.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "eval/sandbox.h"

namespace sigma::eval::detail {

inline constexpr std::string_view kSentinel = "SIGMA-SANDBOX-END\n";

// What a language's sample runs (sandbox_lang.cpp): strings the evaluator prepares before fork.
struct LanguagePlan {
  std::string exe;                    // real path of the program exec'd
  std::string guard, guard_file;      // the guard's source and its file in /box
  std::string program_file;           // the sample's file in /box
  std::vector<std::string> args, env;
  uint64_t address_space = 0;         // RLIMIT_AS of the sample's processes; 0 = none
  bool audit_hook = false;            // Python's second line
};
// Throws when the language's program cannot be found, naming the package to install.
LanguagePlan plan_language(SandboxLanguage language, const SandboxLimits& limits, bool memcg);

// Protections the sample got (the bits of a kGot record).
enum : uint16_t {
  kNetns = 1, kOwnUser = 2, kLandlock = 4, kPidns = 8, kQuota = 16, kUserns = 32,
  kScoped = 64, kPrivateRoot = 128, kMemcg = 256,
};

// Where the set-up failed (the bits of a kFail record; its value is errno).
enum Stage : uint16_t {
  kStageNamespaces = 1, kStageFolder, kStageSharedMount, kStageRoot, kStageQuota, kStageCgroup,
  kStageUser, kStageLandlock, kStageFork, kStageChroot,
};

// One record on the report pipe, written whole (far below PIPE_BUF, so writes never interleave).
struct Record {
  uint8_t kind = 0;
  uint8_t pad = 0;
  uint16_t bits = 0;
  int32_t value = 0;
};
enum : uint8_t {
  kGot = 1,     // bits: the protections in force when the sample's process execs python
  kStatus = 2,  // value: the sample's wait status
  kFail = 3,    // bits: the Stage, value: errno
  kOom = 4,     // value: processes the kernel's OOM killer ended in the sample's cgroup
};

// One entry of the sample's root, created in order under the root folder.
struct RootEntry {
  enum Kind : uint8_t { Dir, Bind, BindFile, Link } kind = Dir;
  std::string path;    // absolute on the host: the folder + the path the sample sees
  std::string source;  // Bind, BindFile: the host path; Link: the link's text
};

// The per-sample memory cgroup (v1 or v2), planned by the evaluator (which has checked once
// that it may make one there); the supervisor makes it, joins it, counts its OOM kills,
// leaves it and removes it, so that it exists only while a supervisor does.
struct MemoryCgroup {
  std::string version;  // "v1" or "v2"; "" = none can be made (see why_not)
  std::string dir, events, procs, parent_procs;
  std::vector<std::pair<std::string, std::string>> limits;  // file, value; written in order
  std::string why_not;
};
MemoryCgroup plan_memory_cgroup(const std::string& name, uint64_t bytes);
void remove_cgroup(const std::string& dir);  // the backstop for a supervisor that was killed
// Removes the cgroups named sigma-sandbox-PID-* of evaluators that no longer run.
void remove_stale_cgroups();
// Whether a folder or cgroup name "sigma-sandbox-PID-..." belongs to an evaluator that no
// longer runs.
bool stale_sandbox_name(const std::string& name);

// The uid and gid (the same number) a sample run as root gets for itself alone, so that its
// processes have their own RLIMIT_NPROC count (sandbox_uid.cpp says how the id is chosen and
// why no two samples at once, of any evaluator on this machine, get the same one). Held until
// destroyed (after the sample's supervisor is reaped).
struct SampleUser {
  uint32_t id = 0;
  int lock_fd = -1;  // the socket bound to the id's abstract name; the supervisor inherits it
  SampleUser() = default;
  SampleUser(SampleUser&& o) noexcept { *this = std::move(o); }
  SampleUser& operator=(SampleUser&& o) noexcept;
  ~SampleUser();
  void release();
};
SampleUser take_sample_user();
// Processes whose real uid is `uid` (RLIMIT_NPROC counts all of them).
int processes_of(uid_t uid);

struct ChildPlan {
  pid_t evaluator = 0;
  std::string folder;          // the sample's root: a tmpfs mounted here in its mount namespace
  std::string folder_escaped;  // as /proc/self/mountinfo spells it
  std::string box, guard_path, sample_path, guard, program;  // box: folder + "/box"
  std::vector<RootEntry> entries;
  std::string root_opts, box_opts, uid_map, gid_map;
  std::vector<char*> argv, envp;
  int abi = 0;
  bool as_root = false;  // the sample then runs as its own user (uid, gid)
  uid_t uid = 0;
  gid_t gid = 0;
  int report_fd = -1;    // write end: Records
  int done_fd = -1;      // write end: the guard's sentinel (fd 3 in the sample)
  int out_fd = -1;       // the sample's stdout and stderr (a memfd the evaluator reads)
  uint64_t memory = 0, file = 0;  // memory: RLIMIT_AS, 0 = none
  int nproc = 64;
  double seconds = 0;
  MemoryCgroup cg;
  // Set by the supervisor after fork (its own copy).
  uint16_t got = 0;
  bool made_folder = false, made_cgroup = false, in_cgroup = false;
  pid_t init = 0;
  int root_fd = -1, box_fd = -1;
};

// The supervisor (a child of the evaluator): exits 0 (the sample's status is on the report
// pipe), 124 (timeout), 125 (set-up failed: a kFail record says where) or 126 (stopped: the
// evaluator died or asked it to stop with SIGTERM). It removes the folder and the cgroup
// whatever happens.
[[noreturn]] void supervisor(ChildPlan& p);

}  // namespace sigma::eval::detail
