#include "ecss/gradient_area.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <utility>

#include "core/error.h"
#include "io/file.h"

namespace sigma {

namespace {
uint64_t page_round(uint64_t bytes) {
  const uint64_t page = uint64_t(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}
}  // namespace

GradientArea::GradientArea(int64_t slots, int64_t floats, const std::string& beside_file) {
  SIGMA_CHECK(slots >= 1 && floats >= 1, "gradient area: {} slots of {} floats", slots, floats);
  slot_bytes_ = page_round(uint64_t(floats) * 4);  // slots are released page by page
  map_bytes_ = slot_bytes_ * uint64_t(slots);
  if (beside_file.empty()) {
    where_ = "RAM";
    void* p = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    SIGMA_CHECK(p != MAP_FAILED, "cannot map {} for the experts' gradients: {}",
                gib_str(map_bytes_), errno_str(errno));
    map_ = static_cast<std::byte*>(p);
    return;
  }
  const std::filesystem::path dir = std::filesystem::absolute(beside_file).parent_path();
  where_ = dir.string();
  fd_ = ::open(where_.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  SIGMA_CHECK(fd_ >= 0, "cannot create the experts' gradient file in {} (beside the expert store): "
              "{}", where_, errno_str(errno));
  if (int e = ::posix_fallocate(fd_, 0, off_t(map_bytes_)); e != 0) {
    ::close(fd_);
    fail("cannot reserve {} in {} for the experts' gradients (beside the expert store): {}",
         gib_str(map_bytes_), where_, errno_str(e));
  }
  void* p = ::mmap(nullptr, map_bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
  if (p == MAP_FAILED) {
    const int e = errno;
    ::close(fd_);
    fail("cannot map the experts' gradient file in {} ({}): {}", where_, gib_str(map_bytes_),
         errno_str(e));
  }
  map_ = static_cast<std::byte*>(p);
}

uint64_t GradientArea::bytes_for(int64_t slots, int64_t floats) {
  return page_round(uint64_t(floats) * 4) * uint64_t(slots);
}

GradientArea::GradientArea(GradientArea&& o) noexcept { *this = std::move(o); }

GradientArea& GradientArea::operator=(GradientArea&& o) noexcept {
  if (this != &o) {
    close();
    map_ = std::exchange(o.map_, nullptr);
    map_bytes_ = std::exchange(o.map_bytes_, 0);
    slot_bytes_ = std::exchange(o.slot_bytes_, 0);
    fd_ = std::exchange(o.fd_, -1);
    where_ = std::move(o.where_);
  }
  return *this;
}

GradientArea::~GradientArea() { close(); }

void GradientArea::close() noexcept {
  if (map_) ::munmap(map_, map_bytes_);
  if (fd_ >= 0) ::close(fd_);  // the unnamed file goes with its last descriptor
  map_ = nullptr;
  fd_ = -1;
}

void GradientArea::zero(int64_t first, int64_t count) {
  SIGMA_CHECK(first >= 0 && count >= 0 && uint64_t(first + count) * slot_bytes_ <= map_bytes_,
              "gradient area: slots [{}, {}) of {}", first, first + count, map_bytes_ / slot_bytes_);
  if (count == 0) return;
  const uint64_t offset = uint64_t(first) * slot_bytes_, bytes = uint64_t(count) * slot_bytes_;
  if (fd_ < 0) {  // anonymous: in place, the pages stay (see the header)
    std::memset(map_ + offset, 0, bytes);
    return;
  }
  // Zero the range in the file, dropping its cached pages unwritten; the blocks stay reserved.
  // File systems without ZERO_RANGE: free the blocks, then reserve them again.
  if (::fallocate(fd_, FALLOC_FL_ZERO_RANGE | FALLOC_FL_KEEP_SIZE, off_t(offset), off_t(bytes)) == 0)
    return;
  SIGMA_CHECK(errno == EOPNOTSUPP, "releasing expert gradients in {}: {}", where_, errno_str(errno));
  SIGMA_CHECK(::fallocate(fd_, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, off_t(offset),
                          off_t(bytes)) == 0,
              "releasing expert gradients in {}: {}", where_, errno_str(errno));
  if (int e = ::posix_fallocate(fd_, off_t(offset), off_t(bytes)); e != 0)
    fail("reserving disk for the experts' gradients in {} again: {}", where_, errno_str(e));
}

}  // namespace sigma
