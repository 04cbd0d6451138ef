#include "dist/communicator.h"

#include <cstring>

#include "core/error.h"

namespace sigma {

void SingleProcess::reduce_scatter_sum(float* out, const float* in, int64_t n) {
  if (out != in) std::memmove(out, in, size_t(n) * sizeof(float));
}

void SingleProcess::all_gather(float* out, const float* in, int64_t n) {
  if (out != in) std::memmove(out, in, size_t(n) * sizeof(float));
}

void SingleProcess::all_to_all_v(const float* send, const int64_t* send_counts, float* recv,
                                 const int64_t* recv_counts) {
  SIGMA_CHECK(send_counts[0] == recv_counts[0], "all_to_all_v: one rank sends {} elements to "
              "itself but expects {}", send_counts[0], recv_counts[0]);
  if (recv != send) std::memmove(recv, send, size_t(send_counts[0]) * sizeof(float));
}

void SingleProcess::broadcast(void*, size_t, int root) {
  SIGMA_CHECK(root == 0, "broadcast from rank {} in a single-process run", root);
}

}  // namespace sigma
