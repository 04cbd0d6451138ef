#include "eval/sandbox.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <linux/landlock.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <thread>
#include <vector>

#include "core/error.h"
#include "eval/sandbox_child.h"

namespace fs = std::filesystem;

namespace sigma::eval {

using namespace detail;

namespace {

int landlock_abi() {
  const long v = syscall(SYS_landlock_create_ruleset, nullptr, 0, LANDLOCK_CREATE_RULESET_VERSION);
  return v < 0 ? 0 : int(v);
}

// What the sample's root holds, in the order the supervisor makes it: the system directories
// the interpreter reads (read-only binds; a merged-/usr link stays a link), the interpreter's
// own prefix when it is elsewhere, and /dev's harmless character devices.
std::vector<RootEntry> root_entries(const std::string& folder, const std::string& python) {
  std::vector<RootEntry> out;
  std::vector<std::string> bound;
  for (const char* d : {"/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32", "/etc"}) {
    struct stat st{};
    if (lstat(d, &st) != 0) continue;
    if (S_ISLNK(st.st_mode)) {
      std::error_code ec;
      const fs::path to = fs::read_symlink(d, ec);
      if (!ec) out.push_back({RootEntry::Link, folder + d, to.string()});
    } else if (S_ISDIR(st.st_mode)) {
      out.push_back({RootEntry::Bind, folder + d, d});
      bound.push_back(std::string(d) + "/");
    }
  }
  const fs::path prefix = fs::path(python).parent_path().parent_path();
  if (std::none_of(bound.begin(), bound.end(), [&](const std::string& b) { return (prefix.string() + "/").rfind(b, 0) == 0; })) {
    fs::path at;
    for (const fs::path& part : prefix.parent_path().relative_path()) {
      at /= part;
      out.push_back({RootEntry::Dir, folder + "/" + at.string(), ""});
    }
    out.push_back({RootEntry::Bind, folder + prefix.string(), prefix.string()});
  }
  out.push_back({RootEntry::Dir, folder + "/dev", ""});
  for (const char* d : {"/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"}) {
    struct stat st{};
    if (stat(d, &st) == 0 && S_ISCHR(st.st_mode)) out.push_back({RootEntry::BindFile, folder + d, d});
  }
  return out;
}

// A path as /proc/self/mountinfo spells it (blanks and backslashes as \ooo).
std::string mountinfo_escape(const std::string& s) {
  std::string o;
  for (char c : s)
    if (c == ' ' || c == '\t' || c == '\n' || c == '\\') o += fmt::format("\\{:03o}", int(uint8_t(c)));
    else o += c;
  return o;
}

// Supervisors started and not yet reaped (counted before their fork), and a SIGINT/SIGTERM
// that came meanwhile.
std::atomic<int> g_running{0};
volatile sig_atomic_t g_stop = 0;
static_assert(std::atomic<int>::is_always_lock_free);

[[noreturn]] void die_by(int sig) {
  const char* msg = sig == SIGINT
      ? "sigma eval: interrupted by SIGINT (no sandboxed sample and no sandbox folder is left)\n"
      : "sigma eval: terminated by SIGTERM (no sandboxed sample and no sandbox folder is left)\n";
  (void)!write(2, msg, std::strlen(msg));
  signal(sig, SIG_DFL);
  // Called from the handler too, where `sig` is blocked: raised blocked, it would stay pending
  // and the _exit below would report exit 128 + sig instead of death by the signal.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, sig);
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  raise(sig);
  _exit(128 + sig);
}

extern "C" void on_interrupt(int sig) {
  g_stop = sig;
  // Outside a sample nothing needs stopping; while samples run, the loop that waits for them
  // (run_python_sandboxed_many) stops them all and then ends here.
  if (g_running.load() == 0) die_by(sig);
}

// Folders and cgroups of evaluators killed while a supervisor was killed too (once a process).
void remove_stale(const fs::path& tmp) {
  static std::atomic<bool> done{false};
  if (done.exchange(true)) return;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(tmp, ec)) {
    struct stat st{};
    if (lstat(e.path().c_str(), &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid() &&
        stale_sandbox_name(e.path().filename().string()))
      fs::remove_all(e.path(), ec);
  }
  remove_stale_cgroups();
}

std::string protections_text(uint16_t got, const MemoryCgroup& cg, uint64_t memory, bool audit_hook) {
  std::string s = "rlimits subreaper";
  if (got & kPidns) s += " pidns";
  if (got & kUserns) s += " userns";
  if (got & kNetns) s += " netns";
  if (got & kPrivateRoot) s += " private-root";
  if (got & kQuota) s += " disk-quota";
  s += (got & kMemcg) ? fmt::format(" memcg-{}={}MiB", cg.version, memory >> 20) : " memory-per-process-only";
  if (got & kOwnUser) s += " own-user";
  if (got & kLandlock) s += fmt::format(" landlock-abi{}", landlock_abi());
  if (got & kScoped) s += " signal-scope";
  return s + (audit_hook ? " audit-hook sentinel" : " sentinel");
}

std::string stage_text(uint16_t stage) {
  switch (stage) {
    case kStageNamespaces:
      return "no mount, PID and network namespace for the sample (this needs root, or unprivileged "
             "user namespaces, which a chroot or a container may forbid): refusing to run it "
             "without its private root, disk quota and PID namespace";
    case kStageFolder: return "cannot create the sample's folder";
    case kStageSharedMount:
      return "the disk quota and private root: \"/\" is not a mount point (a chroot) and the "
             "sandbox folder's mount is shared with another mount namespace, so the sample's "
             "tmpfs would appear there too; run in a private mount namespace (unshare "
             "--mount --propagation private) or point TMPDIR at a private mount";
    case kStageRoot: return "cannot build the sample's private root";
    case kStageQuota: return "cannot mount the sample's disk quota (tmpfs)";
    case kStageCgroup: return "cannot join the sample's memory cgroup";
    case kStageUser: return "cannot switch to the sample's own user";
    case kStageLandlock: return "cannot apply Landlock";
    case kStageChroot: return "cannot enter the sample's private root";
    default: return "cannot start the sample";
  }
}

// The last non-empty line of the captured output (at most 300 bytes), for the reason.
std::string last_line(int fd) {
  struct stat st{};
  if (fstat(fd, &st) != 0) return "";
  const off_t from = std::max<off_t>(0, st.st_size - 4096);
  std::string s(size_t(st.st_size - from), '\0');
  const ssize_t n = pread(fd, s.data(), s.size(), from);
  s.resize(size_t(std::max<ssize_t>(n, 0)));
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  const size_t nl = s.rfind('\n');
  std::string line = nl == std::string::npos ? s : s.substr(nl + 1);
  return line.size() > 300 ? line.substr(0, 300) : line;
}

std::string read_available(int fd, size_t most) {
  std::string s;
  char buf[256];
  for (ssize_t n; s.size() < most && (n = read(fd, buf, sizeof buf)) > 0;) s.append(buf, size_t(n));
  return s;
}

}  // namespace

void exit_cleanly_on_interrupt() {
  struct sigaction sa{};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

namespace {

// One sample in flight: its supervisor, the read ends of its pipes and its output. The
// destructor is the backstop for every way out (an exception while others run included): it
// kills and reaps a supervisor not yet reaped, closes the descriptors, and removes the folder
// (an empty directory on this side of the mount namespace) and the cgroup.
struct Running {
  pid_t pid = 0;  // the supervisor, until reaped
  std::string folder, exe;  // exe: what the sample execs (python3, java)
  bool audit_hook = false;
  MemoryCgroup cg;
  uint64_t cg_bytes = 0;
  SampleUser user;  // as root; released (a member) after the destructor has reaped
  int report = -1, done = -1, out = -1;
  std::vector<int> fds;  // every descriptor this side holds
  double seconds = 0;
  std::chrono::steady_clock::time_point deadline;
  bool asked = false;
  int code = -1;  // the supervisor's exit status, once reaped

  Running() = default;
  Running(const Running&) = delete;
  Running& operator=(const Running&) = delete;
  ~Running() {
    reap();
    for (int fd : fds) close(fd);
    std::error_code ec;
    fs::remove(folder, ec);
    remove_cgroup(cg.dir);
  }
  // Kills the supervisor's group and reaps it (the zombie kept the group id from reuse).
  void reap() {
    if (pid <= 0) return;
    kill(-pid, SIGKILL);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
    code = WIFEXITED(status) ? WEXITSTATUS(status) : 124;
    pid = 0;
    g_running.fetch_sub(1);
  }
};

// Forks the supervisor of one sample. `share`: samples that may run at once (as another user
// than root their processes may count together against RLIMIT_NPROC, see below).
std::unique_ptr<Running> start_sandboxed(const SandboxProgram& program, const SandboxLimits& limits, int share) {
  const fs::path tmp = fs::temp_directory_path();
  remove_stale(tmp);
  uint64_t rnd = 0;
  SIGMA_CHECK(getrandom(&rnd, sizeof rnd, 0) == sizeof rnd, "sandbox: getrandom failed: {}", std::strerror(errno));
  // The pid in the name lets a later evaluator remove what a killed one left.
  const std::string name = fmt::format("sigma-sandbox-{}-{:016x}", getpid(), rnd);

  auto run = std::make_unique<Running>();
  ChildPlan p;
  p.evaluator = getpid();
  p.folder = (tmp / name).string();
  run->folder = p.folder;
  p.folder_escaped = mountinfo_escape(p.folder);
  p.box = p.folder + "/box";
  // Its files are in memory too (the tmpfs pages count against the cgroup): the limit leaves
  // room for a full disk quota besides the processes' memory_bytes.
  run->cg_bytes = limits.memory_bytes + limits.disk_bytes;
  p.cg = plan_memory_cgroup(name, run->cg_bytes);
  run->cg = p.cg;
  const LanguagePlan lang = plan_language(program.language, limits, !p.cg.version.empty());
  p.guard = lang.guard;
  p.program = program.source;
  p.guard_path = p.box + "/" + lang.guard_file;
  p.sample_path = p.box + "/" + lang.program_file;
  run->exe = lang.exe;
  run->audit_hook = lang.audit_hook;
  p.entries = root_entries(p.folder, run->exe);
  p.abi = landlock_abi();
  p.as_root = geteuid() == 0;  // the sample then runs as a user of its own
  if (p.as_root) run->user = take_sample_user();
  const uid_t uid = p.as_root ? uid_t(run->user.id) : geteuid();
  const gid_t gid = p.as_root ? gid_t(run->user.id) : getegid();
  p.uid = uid, p.gid = gid;
  p.root_opts = "size=1m,nr_inodes=1024,mode=0755";
  p.box_opts = fmt::format("size={},nr_inodes=4096,mode=0700,uid={},gid={}",
                           std::max<uint64_t>(limits.disk_bytes, 4096), uid, gid);
  p.uid_map = fmt::format("{} {} 1\n", geteuid(), geteuid());
  p.gid_map = fmt::format("{} {} 1\n", getegid(), getegid());
  // RLIMIT_NPROC counts every process of the user. As root the user is the sample's alone. As
  // another user the sample runs in a user namespace as that user: Linux >= 5.14 counts a user
  // namespace's processes on their own (and the user's total against the evaluator's limit),
  // older kernels per user, so there the limit leaves room for `share` samples at once and the
  // user's other processes.
  p.nproc = limits.processes;
  if (!p.as_root) p.nproc = limits.processes * std::max(1, share) + processes_of(geteuid());
  p.memory = lang.address_space;
  p.file = limits.file_bytes;
  p.seconds = limits.seconds;
  std::vector<std::string> args = lang.args, env = lang.env;  // alive until the fork below
  for (std::string& a : args) p.argv.push_back(a.data());
  p.argv.push_back(nullptr);
  for (std::string& e : env) p.envp.push_back(e.data());
  p.envp.push_back(nullptr);

  // Read ends non-blocking: a writer the sample left behind can never stall the evaluator.
  int report[2], done[2];
  SIGMA_CHECK(pipe2(report, O_CLOEXEC) == 0, "sandbox: pipe failed: {}", std::strerror(errno));
  run->fds = {report[0], report[1]};
  SIGMA_CHECK(pipe2(done, O_CLOEXEC) == 0, "sandbox: pipe failed: {}", std::strerror(errno));
  run->fds.insert(run->fds.end(), {done[0], done[1]});
  const int out = memfd_create("sigma-sandbox-output", MFD_CLOEXEC);
  SIGMA_CHECK(out >= 0, "sandbox: memfd_create failed: {}", std::strerror(errno));
  run->fds.push_back(out);
  for (int fd : {report[0], done[0]}) fcntl(fd, F_SETFL, O_NONBLOCK);
  p.report_fd = report[1];
  p.done_fd = done[1];
  p.out_fd = out;
  g_running.fetch_add(1);  // before the fork: a signal from now on waits for this sample
  const pid_t pid = fork();
  if (pid == 0) supervisor(p);
  if (pid < 0) g_running.fetch_sub(1);
  SIGMA_CHECK(pid > 0, "sandbox: fork failed: {}", std::strerror(errno));
  run->pid = pid;
  close(report[1]), close(done[1]);
  run->fds = {report[0], done[0], out};
  run->report = report[0], run->done = done[0], run->out = out;
  setpgid(pid, pid);  // also here, so the group exists before any kill
  // The supervisor keeps the sample's clock itself; this deadline is a backstop for a
  // supervisor that hangs.
  using Clock = std::chrono::steady_clock;
  run->seconds = limits.seconds;
  run->deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(limits.seconds + 10));
  return run;
}

// Whether the supervisor has ended (or its backstop deadline passed). A SIGINT/SIGTERM asks it
// to stop (it then kills the sample and cleans up) and gives it 5 s more at most.
bool supervisor_ended(Running& r) {
  using Clock = std::chrono::steady_clock;
  siginfo_t info{};
  // WNOWAIT: the child stays a zombie, so its group id cannot be reused before killpg.
  if (waitid(P_PID, id_t(r.pid), &info, WEXITED | WNOHANG | WNOWAIT) == 0 && info.si_pid == r.pid) return true;
  if (Clock::now() >= r.deadline) return true;
  if (g_stop && !r.asked) {
    kill(r.pid, SIGTERM);
    r.asked = true;
    r.deadline = std::min(r.deadline, Clock::now() + std::chrono::seconds(5));
  }
  return false;
}

// The outcome of an ended sample: reaps its supervisor and reads what its processes reported.
SandboxResult finish_sandboxed(Running& run) {
  run.reap();
  const int code = run.code;
  SandboxResult r;
  Record rec;
  bool reported = false, have_status = false;
  uint16_t got = 0, stage = 0;
  int st = 0, err = 0;
  while (read(run.report, &rec, sizeof rec) == sizeof rec) {
    if (rec.kind == kGot) got = rec.bits, reported = true;
    if (rec.kind == kStatus) st = rec.value, have_status = true;
    if (rec.kind == kFail && !stage) stage = rec.bits, err = rec.value;
    if (rec.kind == kOom) r.oom_kills = rec.value;
  }
  r.finished = read_available(run.done, 64) == kSentinel;
  r.protections = reported ? protections_text(got, run.cg, run.cg_bytes, run.audit_hook) : "";
  r.timed_out = code == 124;
  have_status = have_status && code == 0;
  if (have_status && WIFEXITED(st)) r.exit_code = WEXITSTATUS(st);
  if (have_status && WIFSIGNALED(st)) r.signal = WTERMSIG(st);
  const std::string tail = last_line(run.out);
  const std::string oom = fmt::format("out of memory: the limit of {} MiB for all its processes and "
                                      "files together ended {} of its processes", run.cg_bytes >> 20, r.oom_kills);
  if (r.timed_out) r.outcome = "timeout", r.why = fmt::format("timeout after {} s", run.seconds);
  else if (stage) r.outcome = "error", r.why = fmt::format("sandbox: {}{}", stage_text(stage), err ? fmt::format(" ({})", std::strerror(err)) : "");
  else if (code == 126) r.outcome = "error", r.why = "the sample was stopped (the evaluator was interrupted)";
  else if (!have_status) r.outcome = "error", r.why = "the sandbox could not be set up";
  else if (r.signal) r.outcome = "killed", r.why = fmt::format("killed by signal {} ({}){}", r.signal, strsignal(r.signal), r.oom_kills ? ": " + oom : "");
  else if (r.exit_code == 127) r.outcome = "error", r.why = fmt::format("cannot run {}", run.exe);
  else if (r.oom_kills) r.outcome = "failed", r.why = oom;
  else if (r.exit_code != 0) r.outcome = "failed", r.why = fmt::format("exit {}: {}", r.exit_code, tail);
  else if (!r.finished) r.outcome = "early_exit", r.why = "exit 0 before the tests finished (sys.exit or os._exit)";
  else r.outcome = "passed", r.why = "ok";
  r.passed = r.outcome == "passed";
  return r;
}

}  // namespace

int default_sandbox_jobs(const SandboxLimits& limits) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  uint64_t available = 0;  // MemAvailable, bytes
  if (FILE* f = std::fopen("/proc/meminfo", "r")) {
    char line[256];
    unsigned long long kb = 0;
    while (std::fgets(line, sizeof line, f))
      if (std::sscanf(line, "MemAvailable: %llu kB", &kb) == 1) available = uint64_t(kb) << 10;
    std::fclose(f);
  }
  const uint64_t each = std::max<uint64_t>(1, limits.memory_bytes + limits.disk_bytes);
  const uint64_t by_memory = available ? std::max<uint64_t>(1, available / each) : 1;
  return int(std::min<uint64_t>({cores, by_memory, 64}));
}

std::vector<SandboxResult> run_sandboxed_many(
    const std::vector<SandboxProgram>& programs, const SandboxLimits& limits, int jobs,
    const std::function<void(size_t, const SandboxResult&)>& on_done) {
  SIGMA_CHECK(jobs >= 1, "sandbox: {} concurrent samples (at least 1)", jobs);
  const int share = int(std::min<size_t>(size_t(jobs), std::max<size_t>(1, programs.size())));
  std::vector<SandboxResult> results(programs.size());
  std::vector<std::pair<size_t, std::unique_ptr<Running>>> running;  // destroyed on every way out
  size_t next = 0;
  while (next < programs.size() || !running.empty()) {
    while (!g_stop && next < programs.size() && running.size() < size_t(share)) {
      running.emplace_back(next, start_sandboxed(programs[next], limits, share));
      ++next;
    }
    if (g_stop) next = programs.size();  // start nothing more; the running ones are stopped
    bool any = false;
    for (size_t k = 0; k < running.size();) {
      if (!supervisor_ended(*running[k].second)) { ++k; continue; }
      const size_t i = running[k].first;
      results[i] = finish_sandboxed(*running[k].second);
      running.erase(running.begin() + std::ptrdiff_t(k));
      if (!g_stop && on_done) on_done(i, results[i]);
      any = true;
    }
    if (!any && !running.empty()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (g_stop) die_by(g_stop);  // interrupted: every sample stopped, its folder and cgroup gone
  return results;
}

std::vector<SandboxResult> run_python_sandboxed_many(
    const std::vector<std::string>& programs, const SandboxLimits& limits, int jobs,
    const std::function<void(size_t, const SandboxResult&)>& on_done) {
  std::vector<SandboxProgram> p;
  p.reserve(programs.size());
  for (const std::string& s : programs) p.push_back({SandboxLanguage::Python, s});
  return run_sandboxed_many(p, limits, jobs, on_done);
}

SandboxResult run_python_sandboxed(const std::string& program, const SandboxLimits& limits) {
  return run_python_sandboxed_many({program}, limits, 1)[0];
}

SandboxResult run_java_sandboxed(const std::string& program, const SandboxLimits& limits) {
  return run_sandboxed_many({{SandboxLanguage::Java, program}}, limits, 1)[0];
}

}  // namespace sigma::eval
