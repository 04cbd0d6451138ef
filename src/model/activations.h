// What backward needs, filled by Model::forward (llm.c's activations struct): one record per
// block plus the head's. Shapes use N = B*T rows, d = model width, f = FFN width, H heads,
// k = experts per row (1 with RRE, 2 with a top-2 gate), Kmax = the widest expert group.
// Buffers are Tensors on the active backend's device (ops::empty); Activations::ensure sizes
// them for (B, T). The host vectors are the host's plan of the pass (rows, groups), uploaded
// to their device twins before an op reads them.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "model/config.h"
#include "model/gate.h"
#include "model/rre.h"

namespace sigma {

// What backward recomputes instead of keeping (train.remat; results are bit-identical):
//   None       every block keeps every buffer of the table below;
//   Attention  one attention output buffer serves every block, recomputed in backward from
//              the kept q, k, v and lse (the flash forward again);
//   Blocks     blocks keep only their input x; backward reruns each block's forward into one
//              shared set of buffers just before that block's backward.
enum class Remat : uint8_t { None, Attention, Blocks };
Remat remat_from_name(const std::string& name);  // "none" | "attention" | "blocks"

struct BlockActs {
  Tensor x;                    // [N,d] block input (residual stream)
  Tensor a1, mean1, rstd1;     // LN1 output [N,d], its row stats [N]
  Tensor qkv;                  // [N,3d] (query layer: the q third is unused)
  Tensor qtop;                 // [T,d] query layer: query table projected by W_q
  Tensor lse;                  // [B,H,T] attention: log-sum-exp of each row's scores (no T x T)
  Tensor att;                  // [N,d] attention output before the output projection
  Tensor mid;                  // [N,d] residual after attention
  Tensor a2, mean2, rstd2;     // LN2 output and stats
  Tensor pre, act;             // [k*N,f] FFN before and after FastGelu (experts: in plan order)
  Tensor yg;                   // [k*N,d] learned-gate block: each expert's output
  RrePlan plan;                // RRE block: rows grouped by expert (gated: the gathered rows)
  GatePlan gplan;              // learned-gate block: choices, gates, gathered layout
};

struct Activations {
  int B = 0, T = 0, tp = 1;
  std::vector<int32_t> rows;       // [N] embedding rows: slot*V + token (tp: this rank's, or -1)
  std::vector<int32_t> row_group;  // [N] expert group of each row (expert blocks)
  Tensor rows_d, targets_d;        // [N] I32 on the device: rows and the batch's targets
  Tensor loss_d, weight_d;         // [N] per-row loss out, loss weights in (device)
  std::vector<BlockActs> blocks;   // [L]
  Tensor h_final;                  // [N,d] output of the last block
  Tensor hf, meanf, rstdf;         // final LayerNorm output [N,d] and stats [N]
  Tensor logits;                   // [N,V/tp]; dL/dlogits after a forward with loss weights
  Tensor xent_stats;               // [tp,N,3] tp > 1: the group's cross-entropy statistics
  bool has_grad = false;           // logits hold dL/dlogits: backward may run
  double weight_sum = 0;           // sum of the loss weights: d(loss)/d(aux loss)
  // Backward and expert scratch (overwritten by every call that uses it).
  Tensor dh, da;                   // [N,d]
  Tensor dq_shared;                // [T,d] query layer: dq summed over the batch
  Tensor gx, gy, gdx;              // [k*N,d] expert gather buffers
  Tensor z;                        // [N,Kmax] learned gate: logits, then their gradient
  Tensor gate_x, gate_dy, gate_dx; // [k*N,d] learned gate: the experts' gathered x, dy, dx
  Tensor dgate;                    // [N*2] learned gate: d(loss)/d(combine weight)
  Tensor tp_sum;                   // [N,d] tensor parallel: a share before its all-reduce
  Remat remat = Remat::None;
  BlockActs work;                  // remat: the buffers blocks share (see Remat)

  // Sizes every buffer for B rows of T positions (no-op when unchanged). With tp > 1 ranks
  // splitting the dense blocks, qkv, att and a dense FFN's pre/act hold this rank's columns,
  // and the logits this rank's share of the vocabulary.
  void ensure(const ModelConfig& cfg, int B, int T, Remat remat = Remat::None, int tp = 1);
  // Block l's buffers (the shared set under Remat::Blocks; its input x is always blocks[l].x)
  // and its attention output.
  BlockActs& block(int l) { return remat == Remat::Blocks ? work : blocks[size_t(l)]; }
  // Block l's attention backward: dL/datt [N, d/tp] then dL/dqkv [N, 3d/tp], in the block's
  // pre ([>= N, 4d/tp]), which its FFN backward has finished with: 4 N x d floats less than
  // buffers of their own.
  float* att_grad(int l) { return block(l).pre.dev_f(); }
  float* qkv_grad(int l, int64_t d_local) { return block(l).pre.dev_f() + int64_t(B) * T * d_local; }
  float* att(int l) { return remat == Remat::None ? blocks[size_t(l)].att.dev_f() : work.att.dev_f(); }
};

}  // namespace sigma
