// Fuzz targets (issue 15): one LLVMFuzzerTestOneInput per parser, each in its own file and
// binary. Built two ways (tests/fuzz/CMakeLists.txt):
//  - always, with replay.cpp as main: ctest replays the seed corpus (tests/fuzz/corpus/NAME/)
//    and a fixed number of deterministic mutations of it, so CI runs every target;
//  - with -DSIGMA_FUZZ=ON under clang: linked with libFuzzer (-fsanitize=fuzzer,address,
//    undefined) for open-ended runs (docs/reliability.md).
// A target accepts any input. Rejections are sigma::Error; anything else escaping (another
// exception type, a crash, a sanitizer report, a broken round trip) is a finding.
#pragma once
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "core/error.h"

namespace sigma::fuzz {

// The input as a file: a memfd, so that file readers (open, read, mmap) see it without disk
// traffic. One per process, rewritten for each input.
inline std::string as_file(const uint8_t* data, size_t size) {
  static int fd = ::memfd_create("sigma-fuzz", 0);
  if (fd < 0 || ::ftruncate(fd, 0) != 0) std::abort();
  for (size_t done = 0; done < size;) {
    const ssize_t w = ::pwrite(fd, data + done, size - done, off_t(done));
    if (w <= 0) std::abort();
    done += size_t(w);
  }
  return "/proc/self/fd/" + std::to_string(fd);
}

// A real directory (for readers that take one), made once per process, removed at exit.
std::string scratch_dir();

// Runs `f`; a sigma::Error is a rejection (fine), everything else propagates.
template <class F>
void expect_clean(F&& f) {
  try {
    f();
  } catch (const sigma::Error&) {
  }
}

[[noreturn]] inline void finding(const char* what) {
  std::fprintf(stderr, "fuzz finding: %s\n", what);
  std::abort();
}

}  // namespace sigma::fuzz
