#include "parallel/grid.h"

#include "core/error.h"

namespace sigma {

RankGrid::RankGrid(Communicator& world, int tp) : world_(world), tp_(tp) {
  const int R = world.size();
  SIGMA_CHECK(tp >= 1 && R % tp == 0,
              "dist.tp = {} does not divide the {} ranks of this run: the ranks form groups of "
              "dist.tp adjacent ranks (use a dist.tp that divides the rank count, or mpirun -np "
              "a multiple of {})", tp, R, tp);
  if (tp == 1) {
    tensor_ = std::make_unique<SingleProcess>();
    data_ = &world;
  } else {
    const int w = world.rank();
    tensor_ = world.split(w / tp);   // ordered by world rank: tp rank = w % tp
    own_data_ = world.split(w % tp);  // data rank = w / tp
    data_ = own_data_.get();
  }
  reducer_.comm = tensor_.get();
}

}  // namespace sigma
