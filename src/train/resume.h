// Continuing a run (`sigma train --resume`): what a changed config changes.
#pragma once
#include <cstdint>
#include <string>

#include "train/config.h"

namespace sigma {

// Steps the learning-rate schedule spans: optim.schedule_steps, else train.steps.
int64_t schedule_total(const Config& c);

// "" when a run resumed at `step` keeps its learning-rate schedule (or has not started: step 0,
// e.g. a surgery output); else one line saying what changes (schedule length, optim.lr,
// optim.warmup, optim.min_lr_ratio), the next step's lr under each, and, when the length
// changed, how to keep the original schedule (optim.schedule_steps).
std::string schedule_change(const Config& before, const Config& after, int64_t step);

}  // namespace sigma
