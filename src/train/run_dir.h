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

namespace sigma {

enum class RunDirMode {
  Fresh,      // OUT must hold no run yet
  Resume,     // OUT may hold the run being continued (metrics after the resumed step dropped)
  Overwrite,  // an existing run in OUT is deleted first (--overwrite)
};

class RunDir {
 public:
  // Creates and locks OUT, checks it against `mode`, then removes checkpoint directories a
  // killed save left behind (checkpoints/NAME.tmp-<pid>, NAME.old-<pid>, which no live
  // process can own while we hold the lock).
  RunDir(std::string out, RunDirMode mode);
  ~RunDir();
  RunDir(const RunDir&) = delete;
  RunDir& operator=(const RunDir&) = delete;

  const std::string& path() const { return out_; }
  std::string checkpoints() const { return out_ + "/checkpoints"; }
  std::string metrics() const { return out_ + "/metrics.jsonl"; }
  int stale_removed() const { return stale_removed_; }      // leftover temporary directories
  int metrics_dropped() const { return metrics_dropped_; }  // by drop_metrics_after

  // A resumed run: drops the metrics.jsonl records of steps after `step` (logged by the run
  // that died before its next checkpoint, and logged again now) and a torn last line.
  void drop_metrics_after(int64_t step);

 private:
  void lock();
  void check_mode(RunDirMode mode);
  void remove_stale_checkpoints();

  std::string out_;
  int fd_ = -1;
  int stale_removed_ = 0, metrics_dropped_ = 0;
};

// Whether OUT already holds a training run (metrics.jsonl, summary.json or checkpoints/).
bool holds_run(const std::string& out);

}  // namespace sigma
