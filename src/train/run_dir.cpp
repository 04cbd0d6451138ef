#include "train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <fmt/format.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <vector>

#include "core/error.h"
#include "core/json_depth.h"
#include "io/checkpoint_dir.h"
#include "io/file.h"

namespace sigma {

namespace fs = std::filesystem;

namespace {
constexpr const char* kLockFile = ".lock";
constexpr const char* kRunFiles[] = {"metrics.jsonl", "summary.json", kRunCheckpointsDir};
constexpr const char* kReplaced = ".replaced-";  // OUT/.replaced-<pid>: an old run set aside

// The pid holding the flock on `fd`'s file, as the kernel records it (/proc/locks lines read
// "N: FLOCK ADVISORY WRITE PID MAJ:MIN:INODE ..."); the file's own text (the pid its owner
// wrote just after locking) only where /proc/locks is unreadable, so that the message never
// shows an empty or an earlier owner's pid while the new owner is between lock and write.
std::string lock_owner(int fd) {
  struct stat st;
  if (::fstat(fd, &st) == 0) {
    const std::string id = fmt::format("{:02x}:{:02x}:{}", major(st.st_dev), minor(st.st_dev),
                                       uint64_t(st.st_ino));
    std::ifstream locks("/proc/locks");
    for (std::string line; std::getline(locks, line);) {
      if (line.find("->") != std::string::npos || line.find(" FLOCK ") == std::string::npos)
        continue;  // a waiter, or a POSIX lock
      std::istringstream in(line);
      std::string n, kind, adv, rw, pid, file;
      if (in >> n >> kind >> adv >> rw >> pid >> file && file == id) return pid;
    }
  }
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string s = n > 0 ? std::string(buf, size_t(n)) : "";
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.empty() ? "unknown" : s;
}
}  // namespace

bool holds_run(const std::string& out) {
  std::error_code ec;
  for (const char* f : kRunFiles)
    if (fs::exists(fs::path(out) / f, ec)) return true;
  return false;
}

RunDir::RunDir(std::string out, RunDirMode mode) : out_(std::move(out)) {
  std::error_code ec;
  fs::create_directories(out_, ec);
  SIGMA_CHECK(!ec, "cannot create output directory '{}': {}", out_, ec.message());
  lock();
  recover_replaced();
  check_mode(mode);
  remove_stale_checkpoints();
}

RunDir::~RunDir() {
  if (metrics_fd_ >= 0) ::close(metrics_fd_);
  if (!aside_.empty()) {
    try {
      restore_old_run();
      fmt::print(stderr, "sigma train: the new run stopped before its first checkpoint; the "
                 "run it was to replace is back in '{}'\n", out_);
    } catch (const std::exception& e) {
      fmt::print(stderr, "sigma train: error: {} (the replaced run is in '{}')\n", e.what(), aside_);
    }
  }
  if (fd_ >= 0) ::close(fd_);  // releases the lock; the file stays (its pid is only a hint)
}

void RunDir::lock() {
  const std::string path = out_ + "/" + kLockFile;
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  SIGMA_CHECK(fd_ >= 0, "cannot open '{}': {}", path, errno_str());
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    const std::string owner = e == EWOULDBLOCK ? lock_owner(fd_) : "";
    ::close(fd_);
    fd_ = -1;
    SIGMA_CHECK(e != EWOULDBLOCK, "output directory '{}' is in use by another sigma train (pid {}); "
                "wait for it to finish or choose another --out", out_, owner);
    fail("cannot lock '{}': {}", path, errno_str(e));
  }
  // Written over the old text, then cut to length: the file is never empty in between.
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::pwrite(fd_, pid.data(), pid.size(), 0) == ssize_t(pid.size()))
    (void)::ftruncate(fd_, off_t(pid.size()));
}

// --overwrite sets the old run aside in OUT/.replaced-<pid> in steps that a kill can
// interrupt anywhere; two markers in it (each written atomically) say how far it got:
//   moved      the list of the old run's files, written once all are in the aside: from then
//              on a run file in OUT is the new run's;
//   restoring  the old run is being put back (the new run failed or was killed uncommitted).
// A new run has committed once `moved` exists and OUT/checkpoints holds a complete checkpoint
// (its manifest is renamed into place whole): only then may the old run go. Deleting an
// aside first renames it to OUT/.dropped-<pid>, so no half-deleted aside is ever restored.
namespace {
constexpr const char* kDropped = ".dropped-";  // OUT/.dropped-<pid>: being deleted
constexpr const char* kMoved = "moved";
constexpr const char* kRestoring = "restoring";

bool has_committed_checkpoint(const std::string& root) {
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return false;
  try {
    resolve_checkpoint(root);
    return true;
  } catch (const Error&) {
    return false;
  }
}
}  // namespace

// What a killed --overwrite left: a new run that committed keeps OUT, else the old run comes
// back; a half-deleted aside finishes going.
void RunDir::recover_replaced() {
  std::error_code ec;
  std::vector<fs::path> asides;
  for (const auto& e : fs::directory_iterator(out_, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with(kDropped)) fs::remove_all(e.path(), ec);
    else if (name.starts_with(kReplaced)) asides.push_back(e.path());
  }
  for (const fs::path& a : asides) {
    aside_ = a.string();
    if (fs::exists(a / kMoved, ec) && !fs::exists(a / kRestoring, ec) &&
        has_committed_checkpoint(checkpoints())) {
      drop_old_run();
      continue;
    }
    restore_old_run();
    fmt::print(stderr, "sigma train: warning: an earlier --overwrite of '{}' was interrupted "
               "before the new run saved a checkpoint; the run it was replacing is restored\n",
               out_);
  }
}

void RunDir::set_old_run_aside() {
  if (!holds_run(out_)) return;
  aside_ = out_ + "/" + kReplaced + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(aside_, ec);
  SIGMA_CHECK(fs::create_directory(aside_, ec), "--overwrite: cannot create '{}': {}", aside_,
              ec.message());
  std::string moved;
  for (const char* f : kRunFiles) {
    const fs::path from = fs::path(out_) / f;
    if (!fs::exists(fs::symlink_status(from, ec))) continue;
    fs::rename(from, fs::path(aside_) / f, ec);
    SIGMA_CHECK(!ec, "--overwrite: cannot move '{}' aside: {}", from.string(), ec.message());
    moved += std::string(f) + "\n";
  }
  fsync_path(out_, true);
  fsync_path(aside_, true);
  write_file_atomic(aside_ + "/" + kMoved, moved);
}

// Puts the old run back from aside_, from any point a kill left it at: a file still in the
// aside replaces the new run's; a run file the old run did not have is the new run's and goes;
// before `moved` (the set-aside itself was cut) a file not in the aside is the old run's and
// stays.
void RunDir::restore_old_run() {
  if (metrics_fd_ >= 0) ::close(metrics_fd_), metrics_fd_ = -1;
  std::error_code ec;
  const fs::path aside(aside_);
  const bool all_moved = fs::exists(aside / kMoved, ec);
  std::string moved;
  if (all_moved) {
    moved = read_small_file((aside / kMoved).string(), 4096);
    if (!fs::exists(aside / kRestoring, ec)) write_file_atomic((aside / kRestoring).string(), "");
  }
  for (const char* f : kRunFiles) {
    const fs::path old = aside / f, now = fs::path(out_) / f;
    if (fs::exists(fs::symlink_status(old, ec))) {
      fs::remove_all(now, ec);
      fs::rename(old, now, ec);
      SIGMA_CHECK(!ec, "cannot move '{}' back to '{}': {}", old.string(), now.string(), ec.message());
    } else if (all_moved && moved.find(std::string(f) + "\n") == std::string::npos) {
      fs::remove_all(now, ec);
    }
  }
  fsync_path(out_, true);
  drop_old_run();  // only the markers are left in it
}

void RunDir::drop_old_run() {
  if (aside_.empty()) return;
  const std::string name = fs::path(aside_).filename().string();
  const std::string dropped = out_ + "/" + kDropped + name.substr(std::string(kReplaced).size());
  std::error_code ec;
  fs::remove_all(dropped, ec);
  SIGMA_CHECK(::rename(aside_.c_str(), dropped.c_str()) == 0, "cannot rename '{}' to '{}': {}",
              aside_, dropped, errno_str());
  fsync_path(out_, true);
  aside_.clear();
  fs::remove_all(dropped, ec);
}

void RunDir::append_metrics(const std::string& record) {
  const std::string path = metrics();
  if (metrics_fd_ < 0) {
    metrics_fd_ = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    SIGMA_CHECK(metrics_fd_ >= 0, "cannot open '{}': {}", path, errno_str());
  }
  const off_t end = ::lseek(metrics_fd_, 0, SEEK_END);
  const std::string line = record + "\n";
  try {
    write_all(metrics_fd_, line.data(), line.size(), path);
  } catch (...) {
    if (end >= 0) (void)::ftruncate(metrics_fd_, end);  // no torn last line
    throw;
  }
}

void RunDir::sync_metrics() {
  if (metrics_fd_ >= 0)
    SIGMA_CHECK(::fsync(metrics_fd_) == 0, "cannot fsync '{}': {}", metrics(), errno_str());
}

void RunDir::write_summary(const std::string& text) {
  write_file_atomic(out_ + "/summary.json", text);
}

void RunDir::check_mode(RunDirMode mode) {
  if (mode == RunDirMode::Resume || !holds_run(out_)) return;
  SIGMA_CHECK(mode == RunDirMode::Overwrite,
              "output directory '{}' already holds a training run (metrics.jsonl, summary.json or "
              "checkpoints/): continue it with --resume {}/checkpoints, pass --overwrite to "
              "replace it, or choose another --out", out_, out_);
  // The old run stays in place until the new one has been built: set_old_run_aside.
}

// Under the lock no other process writes checkpoints here, so every temporary directory is a
// dead save's (CheckpointWriter writes NAME.tmp-<pid>, and on filesystems without
// RENAME_EXCHANGE moves the old one to NAME.old-<pid>); `latest.tmp-<pid>` likewise.
void RunDir::remove_stale_checkpoints() {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(checkpoints(), ec)) {
    const std::string name = e.path().filename().string();
    if (name.find(".tmp-") == std::string::npos && name.find(".old-") == std::string::npos)
      continue;
    std::error_code rm;
    fs::remove_all(e.path(), rm);
    if (!rm) ++stale_removed_;
  }
}

void RunDir::drop_metrics_after(int64_t step) {
  std::ifstream in(metrics());
  if (!in) return;
  std::string kept;
  for (std::string line; std::getline(in, line);) {
    const auto j = parse_json_or_discard(line);
    if (j.is_object() && j.contains("step") && j["step"].is_number_integer() &&
        j["step"].get<int64_t>() <= step)
      kept += line + "\n";
    else
      ++metrics_dropped_;
  }
  if (metrics_dropped_ > 0) write_file_atomic(metrics(), kept);
}

}  // namespace sigma
