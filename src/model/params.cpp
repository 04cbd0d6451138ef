#include "model/params.h"

#include "kernels/ops.h"

namespace sigma {

Param& ParamSet::add(const std::string& name, Shape shape, bool decay, bool expert) {
  SIGMA_CHECK(!index_.count(name), "parameter '{}' registered twice", name);
  // Reserve up front elsewhere is not needed: callers keep names, never Param references, across adds.
  index_[name] = params_.size();
  params_.push_back(Param{name, ops::empty(DType::F32, shape), ops::empty(DType::F32, shape),
                          decay, expert});  // on the active backend's device
  return params_.back();
}

Param& ParamSet::at(const std::string& name) {
  auto it = index_.find(name);
  SIGMA_CHECK(it != index_.end(), "no parameter named '{}'", name);
  return params_[it->second];
}

const Param& ParamSet::at(const std::string& name) const {
  auto it = index_.find(name);
  SIGMA_CHECK(it != index_.end(), "no parameter named '{}'", name);
  return params_[it->second];
}

int64_t ParamSet::numel() const {
  int64_t n = 0;
  for (const auto& p : params_) n += p.value.numel();
  return n;
}

void ParamSet::zero_grad() {
  for (auto& p : params_) ops::zero(p.grad);
}

Buffer& BufferSet::add(const std::string& name, DType dtype, Shape shape) {
  SIGMA_CHECK(!index_.count(name), "buffer '{}' registered twice", name);
  index_[name] = buffers_.size();
  buffers_.push_back(Buffer{name, Tensor(dtype, std::move(shape), Device::Host)});
  return buffers_.back();
}

Buffer& BufferSet::at(const std::string& name) {
  auto it = index_.find(name);
  SIGMA_CHECK(it != index_.end(), "no buffer named '{}'", name);
  return buffers_[it->second];
}

const Buffer& BufferSet::at(const std::string& name) const {
  auto it = index_.find(name);
  SIGMA_CHECK(it != index_.end(), "no buffer named '{}'", name);
  return buffers_[it->second];
}

}  // namespace sigma
