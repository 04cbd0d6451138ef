#include "core/quiet_signals.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <thread>

namespace sigma {

void route_signals_to_quiet_thread() {
  sigset_t routed;
  sigemptyset(&routed);
  for (int s : {SIGTERM, SIGINT, SIGUSR1, SIGUSR2}) sigaddset(&routed, s);
  pthread_sigmask(SIG_BLOCK, &routed, nullptr);
  std::thread([routed] {
    pthread_sigmask(SIG_UNBLOCK, &routed, nullptr);
    for (;;) pause();  // returns after each handled signal; a default action ends the process
  }).detach();
}

}  // namespace sigma
