// A training output directory (`sigma train --out OUT`) owned by one process.
//
// OUT holds metrics.jsonl, summary.json and checkpoints/. Two trainings writing one OUT would
// replace each other's checkpoints and interleave their metrics, and a fresh run started on an
// old OUT would mix its checkpoints with the old run's: so OUT is locked (flock on OUT/.lock,
// released by the kernel however the process ends), and an OUT that already holds a run is
// refused unless the run resumes or the user asked to overwrite it.
#pragma once
#include <cstdint>
#include <string>

#include "io/checkpoint_dir.h"

namespace sigma {

enum class RunDirMode {
  Fresh,      // OUT must hold no run yet
  Resume,     // OUT may hold the run being continued (metrics after the resumed step dropped)
  Overwrite,  // an existing run in OUT is replaced (--overwrite): see set_old_run_aside
};

class RunDir {
 public:
  // Creates and locks OUT, checks it against `mode`, then removes checkpoint directories a
  // killed save left behind (checkpoints/NAME.tmp-<pid>, NAME.old-<pid>, which no live
  // process can own while we hold the lock).
  // An old run a killed --overwrite left in OUT/.replaced-<pid> comes back first unless the
  // new run committed a checkpoint (then it is deleted): whatever point the kill hit, OUT
  // holds the old run or the new run's checkpoint (run_dir.cpp).
  RunDir(std::string out, RunDirMode mode);
  // An old run still set aside (the new run failed before its first checkpoint) is put back
  // and the new run's files removed: a failed --overwrite deletes nothing.
  ~RunDir();
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;

  const std::string& path() const { return out_; }
  std::string checkpoints() const { return out_ + "/" + kRunCheckpointsDir; }
  std::string metrics() const { return out_ + "/metrics.jsonl"; }
  int stale_removed() const { return stale_removed_; }      // leftover temporary directories
  int metrics_dropped() const { return metrics_dropped_; }  // by drop_metrics_after

  // A resumed run: drops the metrics.jsonl records of steps after `step` (logged by the run
  // that died before its next checkpoint, and logged again now) and a torn last line.
  void drop_metrics_after(int64_t step);

  // --overwrite, once the new run has been built (config, data, memory checked): moves the old
  // run's files into OUT/.replaced-<pid>. They stay there until drop_old_run().
  void set_old_run_aside();
  // The new run committed a checkpoint or finished: the old run set aside is deleted (renamed
  // to OUT/.dropped-<pid> first, so that a kill mid-delete restores nothing half-deleted).
  void drop_old_run();

  // One metrics.jsonl record (a line is appended). The file is created on the first record, so
  // a run that fails before it leaves none. A failed write is an error naming the file, and
  // the file is cut back to its last whole record.
  void append_metrics(const std::string& record);
  // fsyncs metrics.jsonl (with each checkpoint: the records up to it are as durable as it is).
  void sync_metrics();
  // summary.json, replaced durably (io/file.h: temp + fsync + rename).
  void write_summary(const std::string& text);

 private:
  void lock();
  void check_mode(RunDirMode mode);
  void remove_stale_checkpoints();
  void recover_replaced();
  void restore_old_run();

  std::string out_;
  int fd_ = -1;
  int metrics_fd_ = -1;
  std::string aside_;  // OUT/.replaced-<pid> while the old run waits there
  int stale_removed_ = 0, metrics_dropped_ = 0;
};

// Whether OUT already holds a training run (metrics.jsonl, summary.json or checkpoints/).
bool holds_run(const std::string& out);

}  // namespace sigma
