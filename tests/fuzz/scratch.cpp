#include <cstdlib>
#include <filesystem>
#include <string>

#include "fuzz.h"

namespace sigma::fuzz {

std::string scratch_dir() {
  static std::string dir = [] {
    std::string t = (std::filesystem::temp_directory_path() / "sigma-fuzz-XXXXXX").string();
    if (!::mkdtemp(t.data())) std::abort();
    static std::string keep = t;
    std::atexit([] { std::error_code ec; std::filesystem::remove_all(keep, ec); });
    return t;
  }();
  return dir;
}

}  // namespace sigma::fuzz
