#include "train/checkpoint_async.h"

#include <fmt/format.h>
#include <pthread.h>
#include <sys/mman.h>

#include <cerrno>
#include <csignal>
#include <cstring>
#include <memory>
#include <utility>

#include "core/error.h"

namespace sigma {

namespace {

int64_t ref_bytes(const TensorRef& t) {
  int64_t n = int64_t(dtype_size(t.dtype));
  for (int64_t s : t.shape) n *= s;
  return n;
}

// Large tensors are copied by the run's OpenMP threads (idle between steps): one core's
// memcpy is several times slower than the machine's memory.
void copy_bytes(std::byte* to, const void* from, int64_t n) {
  constexpr int64_t kChunk = int64_t(1) << 22;
  const auto* src = static_cast<const std::byte*>(from);
#pragma omp parallel for schedule(static) if (n > 4 * kChunk)
  for (int64_t at = 0; at < n; at += kChunk)
    std::memcpy(to + at, src + at, size_t(std::min(kChunk, n - at)));
}

}  // namespace

SnapshotBuffer::~SnapshotBuffer() { resize(0); }

SnapshotBuffer::SnapshotBuffer(SnapshotBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}

SnapshotBuffer& SnapshotBuffer::operator=(SnapshotBuffer&& o) noexcept {
  std::swap(data_, o.data_), std::swap(size_, o.size_);
  return *this;
}

void SnapshotBuffer::resize(int64_t size) {
  if (size == size_) return;
  if (data_) ::munmap(data_, size_t(size_));
  data_ = nullptr, size_ = 0;
  if (size == 0) return;
  void* p = ::mmap(nullptr, size_t(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  SIGMA_CHECK(p != MAP_FAILED, "cannot allocate {} bytes for a checkpoint snapshot "
              "(train.ckpt_async): {}; set train.ckpt_async = false to save without one",
              size, std::strerror(errno));
  ::madvise(p, size_t(size), MADV_HUGEPAGE);  // a hint; failures are fine
  data_ = static_cast<std::byte*>(p), size_ = size;
}

void SaveSnapshot::add_safetensors(const std::string& file, const std::vector<TensorRef>& tensors,
                                   const Metadata& meta) {
  int64_t total = 0;
  for (const TensorRef& t : tensors) total += ref_bytes(t);
  if (used_ == buffers_->size()) buffers_->emplace_back();
  SnapshotBuffer& buf = (*buffers_)[used_++];
  buf.resize(total);  // the same size at every save: no new memory after the first
  std::vector<TensorRef> copies;
  int64_t at = 0;
  for (const TensorRef& t : tensors) {
    const int64_t n = ref_bytes(t);
    if (t.parts.empty()) {
      copy_bytes(buf.data() + at, t.data, n);
    } else {
      const int64_t piece = n / int64_t(t.parts.size());
      for (size_t p = 0; p < t.parts.size(); ++p)
        copy_bytes(buf.data() + at + int64_t(p) * piece, t.parts[p], piece);
    }
    copies.push_back({t.name, t.dtype, t.shape, buf.data() + at});
    at += n;
  }
  later_.push_back([file, copies = std::move(copies), meta](CheckpointWriter& w) {
    w.add_safetensors(file, copies, meta);
  });
}

void SaveSnapshot::add_json(const std::string& file, const nlohmann::json& j) {
  later_.push_back([file, j](CheckpointWriter& w) { w.add_json(file, j); });
}

void SaveSnapshot::add_file_copy(const std::string& file, const std::string& src_path) {
  later_.push_back([file, src_path](CheckpointWriter& w) { w.add_file_copy(file, src_path); });
}

void SaveSnapshot::write(CheckpointWriter& w) {
  for (auto& f : first_) f(w);
  first_.clear();  // the live state is free for the training thread again
  for (auto& f : later_) f(w);
}

BackgroundSaver::~BackgroundSaver() {
  if (writer_.joinable()) writer_.join();
}

SaveSnapshot BackgroundSaver::snapshot() {
  SIGMA_CHECK(!in_flight(), "internal: a checkpoint snapshot while the last save is in flight");
  return SaveSnapshot(buffers_);
}

void BackgroundSaver::start(std::string root, std::string name, SaveSnapshot files) {
  auto f = std::make_shared<SaveSnapshot>(std::move(files));  // std::function copies
  start_job(name, [root = std::move(root), name, f] {
    struct Release {  // a write that failed early releases the store too
      SaveSnapshot& f;
      ~Release() { f.clear(); }
    } release{*f};
    CheckpointWriter w(root, name);
    f->write(w);
    return w.commit();
  });
}

void BackgroundSaver::start_job(std::string name, std::function<std::string()> job) {
  SIGMA_CHECK(!in_flight(), "internal: two background saves at once");
  name_ = std::move(name);
  dir_.clear();
  error_ = nullptr;
  done_ = false;
  writer_ = std::thread([this, job = std::move(job)]() mutable {
    // Stop signals go to the training thread, which decides when to stop.
    sigset_t stop;
    sigemptyset(&stop);
    for (int s : {SIGTERM, SIGINT, SIGUSR1, SIGUSR2}) sigaddset(&stop, s);
    pthread_sigmask(SIG_BLOCK, &stop, nullptr);
    try {
      dir_ = job();
    } catch (...) {
      error_ = std::current_exception();
    }
    job = nullptr;  // what it holds goes before the training thread hears it is done
    done_.store(true, std::memory_order_release);
  });
}

std::string BackgroundSaver::wait() {
  if (!writer_.joinable()) return "";
  writer_.join();
  if (!error_) return dir_;
  std::string what = "unknown error";
  try {
    std::rethrow_exception(std::exchange(error_, nullptr));
  } catch (const std::exception& e) {
    what = e.what();
  }
  fail("checkpoint {} was not saved (written in the background, train.ckpt_async): {}; the "
       "checkpoints committed before it are intact", name_, what);
}

}  // namespace sigma
