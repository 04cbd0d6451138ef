// The rank grid (issue 26): tensor parallelism composed with data and expert parallelism.
// The world's R ranks form R / tp tensor-parallel groups of tp adjacent ranks (Megatron's
// order: the group's all-reduces, one per split layer and pass, stay between neighbours).
// World rank w is rank w % tp of tensor-parallel group w / tp, and rank w / tp of the data
// group w % tp: the R / tp ranks that hold the same slices. Data parallelism (ZeRO-1) and
// expert parallelism run on the data group exactly as they run on the world at tp = 1 (the
// paper's 64-way expert and 64-way data parallelism are the same 64 ranks, each a tp group
// of 8 devices). Both groups are made by Communicator::split.
#pragma once
#include <memory>

#include "dist/communicator.h"
#include "model/tensor_parallel.h"

namespace sigma {

class RankGrid {
 public:
  // Collective over `world` (two splits; none at tp = 1, where the data group is the world
  // itself and the tp group one rank). Throws, before any split, when tp does not divide
  // the world's size.
  RankGrid(Communicator& world, int tp);
  RankGrid(const RankGrid&) = delete;
  RankGrid& operator=(const RankGrid&) = delete;

  int tp() const { return tp_; }
  Communicator& world() { return world_; }
  Communicator& tensor() { return *tensor_; }  // this rank's tp group
  Communicator& data() { return *data_; }      // the ranks holding the same slices as this one
  // The model's view of the tp group (model/tensor_parallel.h).
  TpGroup tp_group() { return {tensor_->rank(), tensor_->size(), &reducer_}; }

 private:
  struct Reducer final : TpReducer {
    Communicator* comm = nullptr;
    void all_reduce_sum(float* data, int64_t n) override { comm->all_reduce_sum(data, size_t(n)); }
  };
  Communicator& world_;
  int tp_;
  std::unique_ptr<Communicator> tensor_;
  std::unique_ptr<Communicator> own_data_;  // null at tp = 1: the data group is the world
  Communicator* data_ = nullptr;
  Reducer reducer_;
};

}  // namespace sigma
