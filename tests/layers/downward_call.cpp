// The control for upward_call.cpp: a call down into core/, from the model layer, links.
#include "core/tensor.h"

const char* planted_downward_call() { return sigma::dtype_name(sigma::DType::F32); }
