// The non-finite guard: a step whose loss or gradient norm is NaN or Inf is not applied.
//
// TrainStep decides with `finite_step` on values already reduced over every data-parallel
// rank (the global loss and the global gradient norm), so all ranks skip the same steps and
// stay identical. A skipped step changes no weight, no Adam moment and no Adam step count; the
// run loop still consumes its batches (retrying the same batch would fail the same way) and
// counts it. After `limit` skipped steps in a row the run stops with an error: the weights
// have stopped making progress, and the last checkpoint, written before, is intact.
#pragma once
#include <cstdint>
#include <string>

namespace sigma {

inline bool finite_step(double loss, double grad_norm) {
  // Written without std::isfinite so that it survives -ffinite-math-only builds: NaN != NaN,
  // and |Inf| compares greater than every finite double.
  auto finite = [](double x) { return x == x && x - x == 0.0; };
  return finite(loss) && finite(grad_norm);
}

class NonfiniteGuard {
 public:
  // `limit`: consecutive skipped steps tolerated (train.max_nonfinite_steps); 0 stops at once.
  explicit NonfiniteGuard(int limit) : limit_(limit) {}

  // Records step `step` (1-based, as logged): `skipped` when its update was not applied.
  // Throws sigma::Error, naming the steps and values, once more than `limit` steps in a row
  // were skipped.
  void record(int64_t step, bool skipped, double loss, double grad_norm);

  int64_t skipped_total() const { return total_; }
  // " | skipped N" for the progress line once a step was skipped, else "".
  std::string progress_note() const;
  int consecutive() const { return run_; }

 private:
  int limit_;
  int run_ = 0;
  int64_t total_ = 0;
};

}  // namespace sigma
