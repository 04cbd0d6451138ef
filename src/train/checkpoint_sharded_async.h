// Background sharded saves (train.ckpt_async on several ranks, docs/checkpoints.md): between
// two steps every rank takes what it writes (its pieces of the weights, its Adam shard, its
// experts; the lead also the run files) into snapshot buffers reused from save to save, and
// the next steps run while a writer thread per rank writes that rank's shard files into the
// lead's temporary directory. The writer threads never communicate (MPI runs at
// MPI_THREAD_FUNNELED: only the training thread calls it). The ranks agree on the training
// thread: at each step boundary while a save is in flight, one sum over the world of "my
// writer has finished"; once it is every rank, the records go to the lead, which commits, or
// every rank throws naming the rank whose write failed. At most one save is in flight: the
// next save and the end of the run wait for it.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "dist/communicator.h"
#include "ecss/expert_files.h"
#include "optim/adamw.h"
#include "run/checkpoint.h"
#include "train/checkpoint_async.h"
#include "train/checkpoint_sharded.h"

namespace sigma {

class ShardedBackgroundSaver {
 public:
  ShardedBackgroundSaver(Communicator& data, Communicator& tp) : data_(data), tp_(tp) {}
  // Waits for this rank's writer; a save the ranks have not agreed on is not committed (the
  // lead removes its temporary directory).
  ~ShardedBackgroundSaver() = default;
  ShardedBackgroundSaver(const ShardedBackgroundSaver&) = delete;
  ShardedBackgroundSaver& operator=(const ShardedBackgroundSaver&) = delete;

  bool in_flight() const { return save_ != nullptr; }
  // Collective (every rank, between the same two steps, none in flight): the save's plan
  // (train/checkpoint_sharded.h), this rank's copy, its writer started. `before_write` runs
  // on the writer thread first (tests). A copy that fails here fails the save at collect().
  void start(const std::string& root, Config& cfg, const Model& model, const AdamW* opt,
             const TrainerState& st, const std::string& tokenizer_path, ExpertFiles* experts,
             std::function<void()> before_write);
  // Collective, with a save in flight. `wait`: this rank's writer is waited for. Otherwise the
  // ranks sum over `world` whether each one's writer has finished and go on ("" returned)
  // unless all have. Then the lead commits (the committed directory is returned) or every
  // rank throws naming the failed rank; the save is no longer in flight either way.
  std::string collect(bool wait, Communicator& world);
  // An error path (not collective: the other ranks may be gone): waits for this rank's writer
  // and drops the save uncommitted. Returns its name ("" when none was in flight).
  std::string abandon();
  // Bytes of this rank's last copy (its snapshot buffers).
  int64_t copied_bytes() const { return copied_; }

 private:
  Communicator& data_;
  Communicator& tp_;
  ExpertFiles* experts_ = nullptr;
  int64_t copied_ = 0;
  std::unique_ptr<ShardedSave> save_;  // declared before thread_: the writer goes first
  BackgroundSaver thread_;
};

}  // namespace sigma
