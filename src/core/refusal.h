// A refusal: an error every rank of a distributed run reaches alike (a check of the config
// against the launch, train/preflight.h). The CLI prints it once, from rank 0, not once per rank
// (apps/sigma.cpp). Its own header: core/error.h is in every file.
#pragma once
#include "core/error.h"

namespace sigma {

struct Refusal : Error {
  using Error::Error;
};

}  // namespace sigma
