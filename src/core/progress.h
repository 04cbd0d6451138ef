// One progress line on stderr for a long step of a command (tokenizer train, eval): done/total,
// percent and ETA. On a terminal the line is redrawn in place at most every 2 s; otherwise (a
// log file, CI) a new line every 10 s. Nothing is shown in the first interval, so quick runs
// stay quiet. SIGMA_PROGRESS_SECONDS overrides the non-terminal interval (0: every update; for
// tests). update() may be called from any thread and is cheap between prints.
#pragma once
#include <fmt/format.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <string>

namespace sigma {

// "4m07s", or "2h13m" past an hour: the ETA and elapsed time of every progress line.
inline std::string format_duration(double s) {
  const int64_t t = int64_t(s + 0.5);
  return t >= 3600 ? fmt::format("{}h{:02d}m", t / 3600, t / 60 % 60)
                   : fmt::format("{}m{:02d}s", t / 60, t % 60);
}

class Progress {
 public:
  // `what`: the line's start ("sigma eval: choices"); `unit`: what is counted ("units").
  Progress(std::string what, uint64_t total, std::string unit, bool on = true)
      : what_(std::move(what)), unit_(std::move(unit)), total_(total), on_(on && total > 0),
        tty_(::isatty(STDERR_FILENO) != 0) {
    const char* s = std::getenv("SIGMA_PROGRESS_SECONDS");
    every_s_ = tty_ ? 2.0 : s && *s ? std::atof(s) : 10.0;
    next_s_ = every_s_;
  }
  Progress(const Progress&) = delete;
  Progress& operator=(const Progress&) = delete;
  ~Progress() { finish(); }

  // Adds n to the count done and shows the line when its interval has passed.
  void add(uint64_t n = 1) { show(done_.fetch_add(n) + n); }
  void set(uint64_t done) {
    done_ = done;
    show(done);
  }
  // Ends a terminal line that was drawn (the next output starts on a line of its own).
  void finish() {
    const std::lock_guard lock(mu_);
    if (drawn_ && tty_) fmt::print(stderr, "\n");
    drawn_ = false;
  }

 private:
  void show(uint64_t done) {
    if (!on_) return;
    const double s = std::chrono::duration<double>(Clock::now() - t0_).count();
    if (s < next_s_ || !mu_.try_lock()) return;  // another thread is printing
    const std::lock_guard lock(mu_, std::adopt_lock);
    if (s < next_s_) return;
    next_s_ = s + every_s_;
    const double f = double(std::min(done, total_)) / double(total_);
    const double eta = done ? s / double(done) * double(total_ - std::min(done, total_)) : 0;
    fmt::print(stderr, "{}{}: {}/{} {} ({:.0f}%) | {} | ETA {}{}", tty_ ? "\r" : "", what_, done,
               total_, unit_, 100 * f, format_duration(s), format_duration(eta), tty_ ? "   " : "\n");
    drawn_ = true;
  }

  using Clock = std::chrono::steady_clock;
  std::string what_, unit_;
  uint64_t total_;
  bool on_, tty_, drawn_ = false;
  double every_s_, next_s_;
  std::atomic<uint64_t> done_{0};
  std::mutex mu_;
  Clock::time_point t0_ = Clock::now();
};

}  // namespace sigma
