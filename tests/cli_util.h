// Runs the sigma binary (or any shell command) and captures its exit code and output.
#pragma once
#include <array>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <sys/wait.h>
#include <unistd.h>

#include "core/error.h"

namespace sigma::testing {

struct CmdResult {
  int code;
  std::string out;  // stdout and stderr together
};

// The message of the sigma::Error that f throws ("" when it throws none).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

inline CmdResult run_cmd(const std::string& cmd) {
  CmdResult r{-1, ""};
  FILE* p = popen((cmd + " 2>&1").c_str(), "r");
  if (!p) return r;
  std::array<char, 4096> buf;
  size_t n;
  while ((n = fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  const int st = pclose(p);
  r.code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  return r;
}

inline CmdResult sigma_cmd(const std::string& args) {
  return run_cmd(std::string(SIGMA_BINARY) + " " + args);
}

// A fresh, uniquely named directory under the system temp dir, removed when the object dies.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& tag = "t") {
    std::string tmpl = (std::filesystem::temp_directory_path() / ("sigma-test-" + tag + "-XXXXXX")).string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed for " + tmpl);
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;  // a test may have made it read-only
    std::filesystem::permissions(path, std::filesystem::perms::owner_all, ec);
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string str() const { return path.string(); }
  std::string operator/(const std::string& s) const { return (path / s).string(); }
};

}  // namespace sigma::testing
