#include "train/checkpoint_sharded_async.h"

#include <exception>
#include <utility>

#include "core/error.h"
#include "train/checkpoint.h"

namespace sigma {

void ShardedBackgroundSaver::start(const std::string& root, Config& cfg, const Model& model,
                                   const AdamW* opt, const TrainerState& st,
                                   const std::string& tokenizer_path, ExpertFiles* experts,
                                   std::function<void()> before_write) {
  SIGMA_CHECK(!save_, "internal: two sharded background saves at once");
  experts_ = experts;
  save_ = begin_sharded_save(root, cfg, model, opt, st, experts, data_, tp_);  // collective
  auto files = std::make_shared<SaveSnapshot>(thread_.snapshot());
  copied_ = 0;
  try {  // the copy: the training state is free for the next step after it
    add_shard_files(*files, *save_);
    if (save_->lead) add_run_files(*files, cfg, st, tokenizer_path);
    for (const auto* refs : {&save_->mine.model, &save_->mine.adam})
      for (const TensorRef& t : *refs) copied_ += int64_t(dtype_size(t.dtype)) * shape_numel(t.shape);
  } catch (const std::exception& e) {
    save_->error = e.what();
    save_->tmp.clear();  // nothing written: the record says it failed
  }
  save_->mine = {};  // views of the live state and their copies' sources: not read again
  ShardedSave* s = save_.get();
  thread_.start_job(save_->name, [s, files, hook = std::move(before_write)] {
    if (hook) hook();
    write_sharded_files(*s, [&](CheckpointWriter& w) { files->write(w); });
    files->clear();
    return std::string();
  });
}

std::string ShardedBackgroundSaver::collect(bool wait, Communicator& world) {
  if (!save_) return "";
  if (!wait) {
    double done = thread_.finished() ? 1.0 : 0.0;
    world.all_reduce_sum(&done, 1);
    if (done < double(world.size())) return "";
  }
  thread_.wait();  // the job keeps its failure in the record: it does not throw
  return finish_sharded_save(std::move(save_), experts_, data_, tp_);
}

std::string ShardedBackgroundSaver::abandon() {
  if (!save_) return "";
  try {
    thread_.wait();
  } catch (const std::exception&) {
  }
  const std::string name = save_->name;
  save_.reset();
  return name;
}

}  // namespace sigma
