#include "train/stop_signals.h"

#include <unistd.h>

#include <atomic>

#include "train/trainer.h"

namespace sigma {

namespace {

std::atomic<int> g_stop_signal{0};

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal.exchange(sig) != 0) {
    ::signal(sig, SIG_DFL);
    ::raise(sig);
    return;
  }
  const char msg[] = "\nsigma train: signal received: stopping after this step with a checkpoint "
                     "(send it again to stop at once, without saving)\n";
  (void)!::write(STDERR_FILENO, msg, sizeof msg - 1);
}

}  // namespace

StopSignals::StopSignals(bool install) : installed_(install) {
  if (!installed_) return;
  g_stop_signal = 0;
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &sa, &old_[i]);
}

StopSignals::~StopSignals() {
  if (!installed_) return;
  for (size_t i = 0; i < std::size(kSignals); ++i) ::sigaction(kSignals[i], &old_[i], nullptr);
}

int StopSignals::requested(Communicator& comm, bool limited, bool time_up) const {
  const int sig = installed_ ? g_stop_signal.load() : 0;
  if (comm.size() == 1 || (!installed_ && !limited)) return sig ? sig : time_up ? kStoppedByTimeLimit : 0;
  double v[3] = {sig ? 1.0 : 0.0, double(sig), time_up ? 1.0 : 0.0};
  comm.all_reduce_sum(v, 3);
  if (sig) return sig;
  if (v[0] > 0) return int(v[1] / v[0] + 0.5);  // the ranks that got one got the same
  return v[2] > 0 ? kStoppedByTimeLimit : 0;
}

}  // namespace sigma
