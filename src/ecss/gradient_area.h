// Where ECSS accumulates a step's expert gradients (docs/ecss.md, "Memory budget"): a slot per
// expert the step activates (as many as the store has experts at most), P floats each on its
// own pages, zero until written. The compute side holds
// only the weights of the experts it is running (train.expert_memory); every backward pass adds
// its experts' gradients into their slots, in micro-batch order, and the lazy Adam reads them
// once per step and releases them.
//
// Backing follows the store's: beside a file-backed store, an unnamed temporary file in the same
// directory (O_TMPFILE: a crash leaves nothing behind), so that the gradients of a step larger
// than RAM live in the page cache, which the kernel can write out, not in the process's own
// anonymous memory; with a store in RAM, anonymous memory mapped lazily. Either way a slot
// costs memory only once written. zero() makes slots read zero again: in RAM in place (a page
// handed back would fault in again the next step, 12-14 us a 4 KiB page on these VMs, ~60x a
// memset of it: 30 % of the default job's step did that), so the memory held is the most slots
// one step has used; in the file by dropping the dirty pages without writing them to disk. The
// file's blocks are reserved at creation, so a full disk is an error then and not a SIGBUS
// mid-step.
#pragma once
#include <cstdint>
#include <string>

namespace sigma {

class GradientArea {
 public:
  GradientArea() = default;
  // `slots` slots of `floats` floats. beside_file: the store file to sit beside ("" = RAM).
  GradientArea(int64_t slots, int64_t floats, const std::string& beside_file);
  GradientArea(GradientArea&&) noexcept;
  GradientArea& operator=(GradientArea&&) noexcept;
  GradientArea(const GradientArea&) = delete;
  GradientArea& operator=(const GradientArea&) = delete;
  ~GradientArea();

  // bytes() of an area of `slots` slots of `floats` floats.
  static uint64_t bytes_for(int64_t slots, int64_t floats);

  float* slot(int64_t i) const { return reinterpret_cast<float*>(map_ + uint64_t(i) * slot_bytes_); }
  uint64_t bytes() const { return map_bytes_; }
  bool file_backed() const { return fd_ >= 0; }

  // Zeroes slots [first, first + count) (see above).
  void zero(int64_t first, int64_t count);

 private:
  void close() noexcept;
  std::byte* map_ = nullptr;
  uint64_t map_bytes_ = 0, slot_bytes_ = 0;
  int fd_ = -1;
  std::string where_;  // for errors: the directory of the file, or "RAM"
};

}  // namespace sigma
