// safetensors: the public tensor file format (DESIGN.md §6), our own reader and writer.
//
// Layout: u64 little-endian N | N bytes of JSON header | byte buffer.
// Header: {"<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//          "__metadata__": {"<key>": "<string>"}}, offsets relative to the buffer start.
// We write the header padded with spaces to a multiple of 8 and the tensors in sorted-name
// order, back to back. The reader accepts any order but treats the file as hostile: every
// inconsistency is a sigma::Error naming the file and the tensor or key.
#pragma once
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace sigma {

// A tensor to write, viewed in place (no copy); `data` holds numel(shape) * dtype_size bytes.
// A tensor stored in pieces (an expert-store tensor stacked over experts whose records are
// apart) gives `parts` instead: equal-sized pieces whose concatenation is the tensor.
struct TensorRef {
  std::string name;
  DType dtype;
  Shape shape;
  const void* data;
  std::vector<const void*> parts = {};
};
inline TensorRef tensor_ref(std::string name, const Tensor& t) {
  return {std::move(name), t.dtype(), t.shape(), t.bytes()};
}

using TensorMap = std::map<std::string, Tensor>;
using Metadata = std::map<std::string, std::string>;

// Views of every tensor in `m`, for writing a map back out.
std::vector<TensorRef> tensor_refs(const TensorMap& m);

// Writes `path` (replacing it) with large direct writes, then fsyncs it. On failure the
// partial file is removed. Names must be unique, non-empty and not "__metadata__".
void write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                       const Metadata& meta);

struct TensorInfo {
  DType dtype;
  Shape shape;
};

struct Safetensors {
  TensorMap tensors;                        // the tensors read
  Metadata metadata;
  std::map<std::string, TensorInfo> index;  // every tensor in the file, read or not
};

// Largest header we parse; a bigger length field means a corrupt or hostile file.
inline constexpr uint64_t kSafetensorsMaxHeader = 100ull << 20;

// Reads the tensors `want` accepts (all without it); every entry is checked either way. With a
// filter, parts of a file larger than RAM can be read one after another.
Safetensors read_safetensors(const std::string& path,
                             const std::function<bool(const std::string&)>& want = nullptr);

// Throws naming `file`, the tensor and the first bad element when an F32 tensor holds a NaN
// or an Inf: weights or Adam moments like that came from a diverged or damaged run, and
// training or evaluating on them would only spread the NaN (other dtypes pass).
void check_finite(const Tensor& t, const std::string& name, const std::string& file);

}  // namespace sigma
