#include "train/nonfinite.h"

#include <fmt/format.h>

#include "core/error.h"

namespace sigma {

void NonfiniteGuard::record(int64_t step, bool skipped, double loss, double grad_norm) {
  if (!skipped) {
    run_ = 0;
    return;
  }
  ++run_;
  ++total_;
  SIGMA_CHECK(run_ <= limit_,
              "training stopped: {} consecutive steps ({}..{}) had a non-finite loss or gradient "
              "norm (last: loss {}, |g| {}) and were skipped; train.max_nonfinite_steps = {}. "
              "The weights are those of step {}; the last checkpoint is intact. Lower optim.lr or "
              "optim.grad_clip, or check the data",
              run_, step - run_ + 1, step, loss, grad_norm, limit_, step - run_);
}

std::string NonfiniteGuard::progress_note() const {
  return total_ ? fmt::format(" | skipped {} non-finite", total_) : "";
}

}  // namespace sigma
