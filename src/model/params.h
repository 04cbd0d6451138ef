// Parameter registry: every trainable tensor has a stable hierarchical name (DESIGN §4), a
// gradient of the same shape, and the optimizer facts that depend on its role.
#pragma once
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace sigma {

struct Param {
  std::string name;
  Tensor value;  // fp32 master weights, on the active backend's device (ops::device())
  Tensor grad;   // same shape and device, accumulated by backward
  bool decay;    // weight decay applies (linear weights only; not biases, LayerNorm, embeddings)
  bool expert;   // an RRE expert tensor (hybrid Adam uses eps_rre for these)
};

class ParamSet {
 public:
  // Registers a zero-initialised parameter; names must be unique.
  Param& add(const std::string& name, Shape shape, bool decay, bool expert = false);
  Param& at(const std::string& name);
  const Param& at(const std::string& name) const;
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  std::vector<Param>& all() { return params_; }
  const std::vector<Param>& all() const { return params_; }
  int64_t numel() const;
  void zero_grad();

 private:
  std::vector<Param> params_;  // registration order = a stable, documented order
  std::map<std::string, size_t> index_;
};

// Elements [begin, end) of parameter `param` (an index into ParamSet::all()): the unit of a
// pass's stages (Model::param_stages), so that one expert of a stacked group tensor is a
// stage of its own.
struct ParamPiece {
  size_t param;
  int64_t begin, end;
  int64_t size() const { return end - begin; }
  // Elements this piece and `o` (of the same param) have in common.
  int64_t overlap(const ParamPiece& o) const {
    return std::max<int64_t>(0, std::min(end, o.end) - std::max(begin, o.begin));
  }
};
using ParamStage = std::vector<ParamPiece>;  // pieces in ascending (param, begin) order
// Param i whole.
inline ParamPiece whole_param(const ParamSet& ps, size_t i) {
  return {i, 0, ps.all()[i].value.numel()};
}

// Non-trainable named tensors of a model (the RRE routing tables): saved and loaded with the
// parameters, never seen by the optimizer. Host memory: the RRE planner reads them on the host
// to group a batch's rows by expert before any op runs.
struct Buffer {
  std::string name;
  Tensor value;
};

class BufferSet {
 public:
  Buffer& add(const std::string& name, DType dtype, Shape shape);  // zero-filled; unique names
  Buffer& at(const std::string& name);
  const Buffer& at(const std::string& name) const;
  bool contains(const std::string& name) const { return index_.count(name) != 0; }
  std::vector<Buffer>& all() { return buffers_; }
  const std::vector<Buffer>& all() const { return buffers_; }

 private:
  std::vector<Buffer> buffers_;
  std::map<std::string, size_t> index_;
};

}  // namespace sigma
