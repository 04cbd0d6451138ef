// Background checkpoints (train.ckpt_async, docs/checkpoints.md): a save's bytes are copied
// off the training state between two steps into buffers reused from save to save, and one
// writer thread writes and commits them (io/checkpoint_dir.h: the same files, the same
// tmp + fsync + rename commit) while the next steps run. At most one save is in flight: the
// next save, the end of the run and every error path wait for it first.
#pragma once
#include <atomic>
#include <cstddef>
#include <exception>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "io/checkpoint_dir.h"

namespace sigma {

// A snapshot buffer, kept from save to save: anonymous memory in transparent huge pages where
// the kernel gives them (the first save's page faults cost seconds in 4 KiB pages on a VM).
class SnapshotBuffer {
 public:
  SnapshotBuffer() = default;
  ~SnapshotBuffer();
  SnapshotBuffer(SnapshotBuffer&& o) noexcept;
  SnapshotBuffer& operator=(SnapshotBuffer&& o) noexcept;
  void resize(int64_t size);  // contents lost when the size changes
  std::byte* data() const { return data_; }

 private:
  std::byte* data_ = nullptr;
  int64_t size_ = 0;
};

// One save's files, taken now and written later by write(). It has CheckpointWriter's adding
// calls, so the code that decides what a checkpoint holds serves both (train/checkpoint.cpp).
class SaveSnapshot {
 public:
  explicit SaveSnapshot(std::vector<SnapshotBuffer>& buffers) : buffers_(&buffers) {}
  SaveSnapshot(SaveSnapshot&&) = default;
  SaveSnapshot& operator=(SaveSnapshot&&) = default;

  // Copies every tensor's bytes into the next buffer (sized to them, kept for the next save).
  void add_safetensors(const std::string& file, const std::vector<TensorRef>& tensors,
                       const Metadata& meta);
  void add_json(const std::string& file, const nlohmann::json& j);
  // The source is read when written (a tokenizer: nothing changes it during a run).
  void add_file_copy(const std::string& file, const std::string& src_path);
  // Files written from state that is not copied (the ECSS store): written first, so that what
  // waits for them (the next update of the store) waits least.
  void add_first(std::function<void(CheckpointWriter&)> write) { first_.push_back(std::move(write)); }

  void write(CheckpointWriter& w);  // the writer thread: every file, in order
  void clear() { first_.clear(), later_.clear(); }  // drops what holds live state

 private:
  std::vector<SnapshotBuffer>* buffers_;
  size_t used_ = 0;  // buffers taken by this snapshot
  std::vector<std::function<void(CheckpointWriter&)>> first_, later_;
};

class BackgroundSaver {
 public:
  BackgroundSaver() = default;
  ~BackgroundSaver();  // waits for a save in flight (the training thread's error wins)
  BackgroundSaver(const BackgroundSaver&) = delete;
  BackgroundSaver& operator=(const BackgroundSaver&) = delete;

  // A snapshot over this saver's buffers; only while no save is in flight.
  SaveSnapshot snapshot();
  // Writes `files` as checkpoint ROOT/NAME on the writer thread and commits it.
  void start(std::string root, std::string name, SaveSnapshot files);
  // Runs `job` on the writer thread (stop signals blocked there); what it returns is what
  // wait() returns, what it throws is wait()'s error. `name`: the checkpoint, for messages.
  void start_job(std::string name, std::function<std::string()> job);
  bool in_flight() const { return writer_.joinable(); }
  bool finished() const { return done_.load(std::memory_order_acquire); }
  // Waits for the save in flight and returns its committed directory; its error, if it
  // failed, as a sigma::Error naming the checkpoint (the earlier ones are untouched).
  std::string wait();

 private:
  std::vector<SnapshotBuffer> buffers_;
  std::thread writer_;
  std::atomic<bool> done_{false};
  std::string name_, dir_;
  std::exception_ptr error_;
};

}  // namespace sigma
