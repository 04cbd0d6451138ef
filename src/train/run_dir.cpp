#include "train/run_dir.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_depth.h"
#include "io/file.h"

namespace sigma {

namespace fs = std::filesystem;

namespace {
constexpr const char* kLockFile = ".lock";
constexpr const char* kRunFiles[] = {"metrics.jsonl", "summary.json", "checkpoints"};

// The pid a lock file names (written by its owner), for the error message; "?" if none.
std::string lock_owner(int fd) {
  char buf[32] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string s = n > 0 ? std::string(buf, size_t(n)) : "";
  while (!s.empty() && (s.back() == '\n' || s.back() == ' ')) s.pop_back();
  return s.empty() ? "?" : s;
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
  check_mode(mode);
  remove_stale_checkpoints();
}

RunDir::~RunDir() {
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
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) == 0) write_all(fd_, pid.data(), pid.size(), path);
}

void RunDir::check_mode(RunDirMode mode) {
  if (mode == RunDirMode::Resume || !holds_run(out_)) return;
  SIGMA_CHECK(mode == RunDirMode::Overwrite,
              "output directory '{}' already holds a training run (metrics.jsonl, summary.json or "
              "checkpoints/): continue it with --resume {}/checkpoints, pass --overwrite to "
              "replace it, or choose another --out", out_, out_);
  std::error_code ec;
  for (const char* f : kRunFiles) {
    fs::remove_all(fs::path(out_) / f, ec);
    SIGMA_CHECK(!ec, "--overwrite: cannot remove '{}/{}': {}", out_, f, ec.message());
  }
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
