// The per-sample memory cgroup: RLIMIT_AS bounds each process, this bounds them together.
// cgroup v1 (a "memory" hierarchy) or v2, whichever this machine has, always below the
// evaluator's own cgroup (/proc/self/cgroup), never elsewhere in the hierarchy.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "eval/sandbox_child.h"

namespace fs = std::filesystem;

namespace sigma::eval::detail {

namespace {

struct CgroupBase {
  std::string version;  // "v1", "v2" or ""
  std::string parent;   // the evaluator's own cgroup folder
  std::string why_not;
};

std::vector<std::string> lines_of(const char* path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

bool has_word(const std::string& list, const std::string& word) {  // comma-separated
  std::stringstream ss(list);
  for (std::string w; std::getline(ss, w, ',');)
    if (w == word) return true;
  return false;
}

// mountinfo escapes blanks and backslashes as \ooo.
std::string unescape(const std::string& s) {
  std::string o;
  for (size_t i = 0; i < s.size(); ++i)
    if (s[i] == '\\' && i + 3 < s.size()) {
      o += char((s[i + 1] - '0') * 64 + (s[i + 2] - '0') * 8 + (s[i + 3] - '0'));
      i += 3;
    } else {
      o += s[i];
    }
  return o;
}

// Where the evaluator's own memory cgroup is: a v1 "memory" hierarchy when one is mounted (a
// hybrid machine's v2 has no memory controller), else v2 where the memory controller is
// enabled for its children.
CgroupBase find_base() {
  std::string v1_path, v2_path;
  bool v1_listed = false;
  for (const std::string& l : lines_of("/proc/self/cgroup")) {
    const size_t a = l.find(':'), b = a == std::string::npos ? a : l.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string ctrls = l.substr(a + 1, b - a - 1), path = l.substr(b + 1);
    if (l.compare(0, a, "0") == 0 && ctrls.empty()) v2_path = path;
    else if (has_word(ctrls, "memory")) v1_path = path, v1_listed = true;
  }
  std::string v1_mount, v1_root, v2_mount, v2_root;
  for (const std::string& l : lines_of("/proc/self/mountinfo")) {
    std::istringstream in(l);
    std::string id, parent, dev, root, point, opts, f;
    in >> id >> parent >> dev >> root >> point >> opts;
    while (in >> f && f != "-") {}
    std::string type, source, super;
    in >> type >> source >> super;
    if (type == "cgroup" && has_word(super, "memory")) v1_mount = unescape(point), v1_root = unescape(root);
    if (type == "cgroup2") v2_mount = unescape(point), v2_root = unescape(root);
  }
  // The path in /proc/self/cgroup is relative to the mount's root (a cgroup namespace).
  auto join = [](const std::string& mount, const std::string& root, const std::string& path) {
    std::string rel = path;
    if (root != "/" && rel.compare(0, root.size(), root) == 0) rel = rel.substr(root.size());
    return (fs::path(mount) / fs::path(rel).relative_path()).string();
  };
  CgroupBase b;
  if (v1_listed && !v1_mount.empty()) {
    b.version = "v1", b.parent = join(v1_mount, v1_root, v1_path);
  } else if (!v2_mount.empty() && !v2_path.empty()) {
    b.parent = join(v2_mount, v2_root, v2_path);
    std::ifstream in(b.parent + "/cgroup.subtree_control");
    std::string ctrls((std::istreambuf_iterator<char>(in)), {});
    if (ctrls.find("memory") != std::string::npos) b.version = "v2";
    else b.why_not = "cgroup v2 without the memory controller for the children of " + b.parent;
  } else {
    b.why_not = "no cgroup memory controller mounted";
  }
  return b;
}

const CgroupBase& base() {
  static const CgroupBase b = find_base();
  return b;
}

bool write_text(const std::string& path, const std::string& text) {
  const int fd = open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = write(fd, text.data(), text.size()) == ssize_t(text.size());
  close(fd);
  return ok;
}

// The evaluator whose pid a name "sigma-sandbox-PID-..." carries no longer runs.
bool owner_gone(const std::string& name) {
  const std::string prefix = "sigma-sandbox-";
  if (name.compare(0, prefix.size(), prefix) != 0) return false;
  size_t end = prefix.size();
  while (end < name.size() && name[end] >= '0' && name[end] <= '9') ++end;
  if (end == prefix.size() || end >= name.size() || name[end] != '-') return false;
  const pid_t pid = pid_t(std::stol(name.substr(prefix.size(), end - prefix.size())));
  return kill(pid, 0) != 0 && errno == ESRCH;
}

}  // namespace

bool stale_sandbox_name(const std::string& name) { return owner_gone(name); }

MemoryCgroup plan_memory_cgroup(const std::string& name, uint64_t bytes) {
  MemoryCgroup cg;
  const CgroupBase& b = base();
  const bool v1 = b.version == "v1";
  auto plan = [&](const std::string& dir) {
    MemoryCgroup c;
    c.version = b.version, c.dir = dir;
    c.events = dir + (v1 ? "/memory.oom_control" : "/memory.events");
    c.procs = dir + "/cgroup.procs", c.parent_procs = b.parent + "/cgroup.procs";
    const std::string limit = std::to_string(bytes);
    c.limits.push_back({dir + (v1 ? "/memory.limit_in_bytes" : "/memory.max"), limit});
    // Swap counts too where it is accounted (v1's memsw must not be below the limit: after it).
    if (v1 && ::access((b.parent + "/memory.memsw.limit_in_bytes").c_str(), F_OK) == 0)
      c.limits.push_back({dir + "/memory.memsw.limit_in_bytes", limit});
    if (!v1 && ::access((b.parent + "/memory.swap.max").c_str(), F_OK) == 0)
      c.limits.push_back({dir + "/memory.swap.max", "0"});
    return c;
  };
  // Once a user: may it make one there? (A user without write access to the hierarchy, as
  // any non-root user under cgroup v1, may not; a forked child may have switched users.)
  static uid_t asked_for = uid_t(-1);
  static std::string why_not;
  if (asked_for != geteuid()) {
    asked_for = geteuid();
    why_not = [&]() -> std::string {
      if (b.version.empty()) return b.why_not;
      const MemoryCgroup probe = plan(b.parent + fmt::format("/sigma-sandbox-{}-probe", getpid()));
      if (mkdir(probe.dir.c_str(), 0755) != 0)
        return fmt::format("cannot create a cgroup in {}: {}", b.parent, std::strerror(errno));
      std::string why;
      for (const auto& [file, value] : probe.limits)
        if (why.empty() && !write_text(file, value)) why = fmt::format("cannot write {}: {}", file, std::strerror(errno));
      if (why.empty() && ::access(probe.procs.c_str(), W_OK) != 0) why = "cannot join " + probe.dir;
      rmdir(probe.dir.c_str());
      return why;
    }();
  }
  if (!why_not.empty()) {
    cg.why_not = why_not;
    return cg;
  }
  return plan(b.parent + "/" + name);
}

void remove_cgroup(const std::string& dir) {
  for (int i = 0; !dir.empty() && i < 200 && rmdir(dir.c_str()) != 0 && errno == EBUSY; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

void remove_stale_cgroups() {
  const CgroupBase& b = base();
  if (b.version.empty()) return;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(b.parent, ec))
    if (e.is_directory(ec) && owner_gone(e.path().filename().string())) rmdir(e.path().c_str());
}

}  // namespace sigma::eval::detail
