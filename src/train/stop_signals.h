// SIGTERM / SIGINT during the steps (schedulers send SIGTERM before they kill), and SIGUSR1 /
// SIGUSR2 (the ones Open MPI's mpirun forwards to every rank: it turns its own SIGTERM into an
// abort that exits 1, docs/distributed.md): the first asks the run to stop after the current
// step with a checkpoint; a second one ends the process at once with the default action (a
// save in progress stays a temporary directory, removed by the next run in OUT).
#pragma once
#include <csignal>
#include <iterator>

#include "dist/communicator.h"

namespace sigma {

class StopSignals {
 public:
  explicit StopSignals(bool install);
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;
  // The signal that asked to stop, else kStoppedByTimeLimit when `time_up` (0 = go on).
  // Collective over the ranks (when any may stop: `limited`, the same on every rank), so that
  // they all stop after the same step even when only some got the signal or passed the limit.
  int requested(Communicator& comm, bool limited, bool time_up) const;

 private:
  static constexpr int kSignals[] = {SIGTERM, SIGINT, SIGUSR1, SIGUSR2};
  bool installed_;
  struct sigaction old_[std::size(kSignals)] {};
};

}  // namespace sigma
