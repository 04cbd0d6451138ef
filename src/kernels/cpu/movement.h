// Data movement on activations (ops::copy, fill, add_into, gather_rows, scatter_rows): what the
// model does to its buffers between kernels, behind the front so that a device backend can own
// the buffers. Exact: no rounding but add_into's one addition per element.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/cpu/contract.h"

namespace sigma::cpu {

void copy(float* dst, const float* src, int64_t n);         // dst = src (no overlap)
// Bytes (no overlap): a host backend's upload, download and device copy alike.
void copy_bytes(void* dst, const void* src, size_t bytes);
void fill(float* dst, float value, int64_t n);              // dst = value
void add_into(float* dst, const float* src, int64_t n);     // dst += src

// dst[j] = src[order[j]] for N rows of width d.
void gather_rows(float* dst, const float* src, const int32_t* order, int64_t N, int64_t d);
// dst[order[j]] = src[j] (assign) or += src[j] (accumulate). order holds no repeats (the RRE
// plan's permutation), so threads never write the same row.
void scatter_rows(float* dst, const float* src, const int32_t* order, int64_t N, int64_t d,
                  bool accumulate);

}  // namespace sigma::cpu
