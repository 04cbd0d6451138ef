// Checks made before a run allocates anything: threads the machine can run, and the memory a
// config needs (so that a model too big for the machine gets a sized error, not bad_alloc).
// Their errors are sigma::Refusal (core/refusal.h): every rank reaches them alike.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "dist/communicator.h"
#include "run/config.h"

namespace sigma {

// train.threads capped to the cores this process may use (0 = all of them). More threads than
// cores only make OpenMP's barriers wait on each other (4096 threads on 2 cores ran 3 tiny
// steps in over 120 s). `note` receives a line saying so when the request was capped.
int usable_threads(int requested, std::string* note);

// The step's batch for `ranks` ranks (mpirun -np R). The global batch G (train.global_batch,
// or train.batch x train.accum) is what a run means; it runs as M micro-batches of b rows,
// each rank an aligned block of M / R, a power of two (the fixed tree that keeps every rank
// count bit-identical: train/train_step.h). Sets train.accum = M and train.global_batch = G;
// when R ranks cannot share the micro-batches of train.batch rows, cuts them smaller (the
// largest b' <= train.batch with G = R * 2^k * b') and says so in the returned note (empty
// otherwise). Throws naming the nearest valid global batches and rank counts when G itself
// cannot be shared.
std::string resolve_batch(TrainConfig& t, int ranks);

// Parameters of the model `m` describes (weights only; routing tables excluded), counted from
// the shapes model/weights.cpp registers. `experts`: the RRE experts' share of it.
struct ParamCount {
  int64_t total = 0;
  int64_t experts = 0;
};
ParamCount count_params(const ModelConfig& m);

// Bytes of RAM a training run of `cfg` needs, roughly: weights, gradients and Adam moments
// (16 bytes a parameter; experts in a file-backed ECSS store are excluded, they are paged)
// plus the activations of one micro-batch.
int64_t training_bytes(const Config& cfg);
// The same without the experts: the shared parameters' 16 bytes each (plus the gradient sum
// tree's partial sums when train.accum > 1) and the activations.
int64_t dense_training_bytes(const Config& cfg);

// train.expert_memory in bytes: "auto" is a quarter of physical memory; else a size such as
// "6GiB", "512MiB", "1.5GB" or a number of bytes. Throws sigma::Error naming the key.
int64_t expert_memory_bytes(const TrainConfig& t);

// Options the run would ignore are refused, not dropped: each one set away from its default in
// a run that cannot apply it is an error naming the option and the run's mode (`experts`: the
// resolved train.experts, "model", "ecss", "vanilla" or "parallel"; `ranks`: the processes;
// `out_dir`: whether the run writes anything). train.expert_memory is checked in every mode.
void refuse_inapplicable_options(const Config& cfg, const std::string& experts, int ranks,
                                 bool out_dir);

// dist.tp against the run: it divides the `world` ranks and model.heads (so d_model and the
// FFN width too), and the experts are not in a per-process store (ECSS, vanilla offload).
// One line naming the key and the values; called before the rank grid is made.
void check_tensor_parallel(const Config& cfg, int world, const std::string& experts);

// The host of each rank of `world` (its hostname, as Open MPI tells nodes apart), gathered in
// rank order. A collective: every rank calls it, whatever its config.
std::vector<std::string> hosts_of_ranks(Communicator& world);

// A tp group is dist.tp adjacent world ranks; it exchanges activations twice per block and
// pass, so it must sit inside one host. Refuses a layout whose groups cross hosts, naming the
// first such group, each host's ranks and the dist.tp values that would fit (issue 38).
void check_tp_within_hosts(const std::vector<std::string>& host_of_rank, int tp);

// "h0: ranks 0-1, h1: ranks 2-3": the hosts in order of their first rank, for the banner.
std::string describe_hosts(const std::vector<std::string>& host_of_rank);

// Throws a sigma::Error stating the estimate when it exceeds the machine's physical memory.
void check_memory(const Config& cfg);

}  // namespace sigma
