// The PanGu-α decoder (DESIGN §1): slot embeddings + learned positions, L-1 pre-LN blocks,
// the query layer (attention query = a learned table of positions), final LayerNorm, tied head.
// The top model.rre_layers blocks have a Random Routed Experts FFN (DESIGN §2) whose routing
// tables are model buffers. forward() saves every activation backward needs in an
// Activations struct (model/activations.h); backward() accumulates into the ParamSet's
// gradients. RRE blocks hand their rows to an ExpertExecutor (model/expert_executor.h).
#pragma once
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "model/activations.h"
#include "model/batch.h"
#include "model/config.h"
#include "kernels/types.h"
#include "model/expert_executor.h"
#include "model/params.h"
#include "model/routing.h"
#include "model/tensor_parallel.h"
#include "model/weights.h"

namespace sigma {

// Tokens each expert of one RRE block received (rows of the forward passes since the reset).
struct BlockLoad {
  int block = 0;                             // absolute block index
  std::vector<std::vector<int64_t>> tokens;  // [G][K_g], groups in config order
  int64_t dropped = 0;                       // learned gate: (row, choice) pairs over capacity
  // Max over groups with tokens of (most loaded expert / mean over the group's experts);
  // 1 = perfectly balanced, 0 when no group received tokens.
  double imbalance() const;
};

// Keys and values of the positions each sequence has seen, for generation: the KV cache is a
// mode of Model::forward (same attention, expert and head code), not a second decoder. Each
// row (sequence) has its own length, so a server can decode sequences of different lengths in
// one step and start a new sequence in a row (clear) while the others continue.
struct KvCache {
  int B = 0;                // sequences
  std::vector<int> length;  // [B] positions cached so far, per sequence
  // [L] of [B, 2, H, context, hd]: a row's keys, then its values, each head's positions
  // contiguous, so that a decode step streams a head's keys instead of reading one hd-float
  // piece every 2d floats (a page apart at d = 512; issue 40).
  // F32, or BF16 (Model::use_kv_cache): keys and values rounded to bf16 as they are cached.
  std::vector<Tensor> kv;
  int64_t context = 0, heads = 0, head_dim = 0;
  DType dtype = DType::F32;
  void reset(const ModelConfig& cfg, int B, DType dtype = DType::F32);
  void clear(int row) { length[size_t(row)] = 0; }
  // Row `to`'s first n positions become row `from`'s (its length is the caller's to set).
  void copy_prefix(int from, int to, int n);
  int64_t bytes() const;  // the keys and values held (every row, the whole context)
};

class Model {
 public:
  // Routing tables: model.routing = "random" builds them from model.routing_seed;
  // "frequency" builds them from `counts` (token counts [V] per group name) when given, and
  // otherwise leaves them unset until load_buffer() fills them (from a checkpoint): a forward
  // pass before that is an error.
  //
  // With external_experts the RRE experts are not model parameters: they live in an expert
  // store (ECSS, src/ecss/ecss_experts.h) and bind_expert() points the model at the copies
  // of the experts a step uses; a forward pass that routes a row to an unbound expert throws.
  //
  // With tp.size > 1 the model is this rank's part of a tensor-parallel group
  // (model/tensor_parallel.h): split tensors hold its slice of the weights the same model on
  // one rank would start from, and forward/backward meet the group in all-reduces (training
  // only: no KV cache, no bf16 weight copies).
  // init_only (ZeRO-3's sharded construction): given the registered parameters, which elements
  // of each to initialise ([params]: the rank's own piece, empty for none); the others stay
  // zero, their pages never written (the host allocator hands out lazily zeroed memory for
  // large tensors), so never resident. Empty: all.
  using InitOnly = std::function<std::vector<ParamPiece>(const ParamSet&)>;
  Model(const ModelConfig& cfg, uint64_t seed, const TokenCounts* counts = nullptr,
        bool external_experts = false, TpGroup tp = {}, const InitOnly& init_only = {});
  // The pieces init_only gave (empty when every parameter was initialised whole).
  const std::vector<ParamPiece>& initialised_only() const { return initialised_only_; }
  // A model whose parameters are zeros, for a load that sets every one of them (load_model
  // refuses a checkpoint that misses one): skips drawing the random initialisation.
  static std::unique_ptr<Model> for_loading(const ModelConfig& cfg, uint64_t seed);
  ~Model();
  Model(const Model&) = delete;
  Model& operator=(const Model&) = delete;

  const ModelConfig& config() const { return cfg_; }
  const TpGroup& tp() const { return tp_; }
  ParamSet& params() { return params_; }
  const ModelWeights& weights() const { return *w_; }
  const ParamSet& params() const { return params_; }
  const BufferSet& buffers() const { return buffers_; }

  // Replaces buffer `name` (a routing table) with `t` after checking it: dtype I32, shape [V],
  // every entry a valid expert of its group. Errors name the key.
  void load_buffer(const std::string& name, const Tensor& t);
  // Throws when a routing table is still unset (model.routing = "frequency" without counts).
  void check_routing_ready() const;

  bool external_experts() const { return external_experts_; }
  // External experts: points expert e (global index, RreWeights::expert) of RRE block `block`
  // at `weights` and `grads`, each the expert's tensors concatenated: w_in [d,f] | b_in [f] |
  // w_out [f,d] | b_out [d] (the expert store's record layout); nullptr unbinds it. grads may
  // be null (an executor that points each pass at gradients of its own).
  void bind_expert(int block, int e, const float* weights, float* grads);
  // The initial weights of expert k of group g in RRE block `block`, in that layout: the
  // values an in-model expert gets, from the same per-expert random streams. With tp > 1
  // both hold this rank's slice of the expert (f/tp columns: tp_slice_expert).
  void init_expert(int block, int g, int k, float* dst) const;

  // Inference weights (`--precision` of generate, eval and serve). Every weight matrix a
  // token's forward pass streams -- QKV, attention output, the FFN and expert matrices, the
  // embedding table (the tied head and the lookup) -- becomes, with Bf16, a copy rounded to
  // nearest even, or with Int8, int8 values with one fp32 scale per output channel (a column
  // of w[in,out]; a row of the embedding table): kernels/cpu/int8.h. The copies lie in one
  // arena on huge pages (allocated first: at the peak the fp32 weights and every copy are
  // held), each fp32 tensor is freed once converted, and every gradient is freed (F32 frees
  // only those; its matrices get the huge-page hint where they lie): the model then holds
  // what inference reads and nothing else (held_bytes), so params()
  // holds empty values for the converted matrices. Activations, biases, LayerNorms, the
  // position and query tables, a learned gate, products and sums stay fp32. backward() is
  // refused from then on. Once per model; not for experts in a store.
  void use_weights(WeightFormat f);
  WeightFormat weight_format() const { return format_; }
  // The type the KV caches of this model's generation keep their keys and values in (those
  // reset after the call): F32 (the default), or BF16, half the bytes a decode step's attention
  // reads and a cache holds, each key and value rounded once to nearest even as it is cached;
  // attention then reads them widened (exact), its products and softmax in fp32
  // (ops::attention_forward_kv16). Anything else is refused.
  void use_kv_cache(DType t);
  DType kv_cache_dtype() const { return kv_dtype_; }
  // Bytes of every tensor the model holds for its weights: parameter values and gradients,
  // buffers (routing tables), and the inference copies with their scales (not the padding that
  // aligns them in their arena: under 2 MiB, and 64 bytes a matrix).
  int64_t held_bytes() const;

  // Expert group index of a domain (index into config().groups), -1 when the model has no groups.
  int domain_group(int domain) const { return domain_group_[size_t(domain)]; }

  // The experts a batch will activate, known before the forward pass (DESIGN §2, what ECSS
  // fetches ahead): per RRE block (in block order), the ascending global expert indices
  // (RreWeights::expert) that receive at least one token. Routing-table models only.
  std::vector<std::vector<int>> active_experts(const Batch& batch) const;

  // Expert load per RRE block (empty for a dense model), accumulated over forward passes
  // (forward(), not forward_cached()).
  const std::vector<BlockLoad>& expert_load() const { return load_; }
  void reset_expert_load();

  // Forward pass over `batch`, saving into `acts`; token_loss[B*T] receives every position's
  // cross-entropy (masked or not). With loss_weight (per token, [B*T]) the objective is
  // sum_i loss_weight[i] * loss[i] + (sum_i loss_weight[i]) * aux_loss(), and the head leaves
  // its gradient dL/dlogits in acts instead of the logits (the fused softmax cross-entropy
  // backward, as llm.c does: it saves a second pass over [N, V]), so backward() can follow.
  void forward(const Batch& batch, Activations& acts, float* token_loss,
               const float* loss_weight = nullptr);
  // Backward pass of the last forward(batch, acts, ..., loss_weight): accumulates (+=) the
  // parameter gradients, and the experts' through the executor.
  void backward(const Batch& batch, Activations& acts);
  // Forward of batch.T new positions per row after its cache row's length (positions length ..
  // length+T-1 attend to every cached position of that row and to themselves); appends their
  // keys and values. Batch row b uses cache row cache_rows[b] (distinct rows), or row b when
  // cache_rows is null. Logits of the new positions in acts.logits; token_loss (null: no
  // cross-entropy is computed) against batch.targets. A row's results do not depend on the
  // other rows' lengths or tokens.
  // Counts no expert load and no auxiliary loss and writes nothing in the model, so passes on
  // distinct caches and activations may run concurrently when the expert executor allows it
  // (ExpertExecutor::concurrent_forward).
  void forward_cached(const Batch& batch, KvCache& cache, Activations& acts, float* token_loss,
                      const int* cache_rows = nullptr);
  // forward_cached up to the keys and values only: appends the batch's positions to the cache
  // (the same bits) and computes nothing that only their outputs need: the top block's
  // attention and FFN and the head. For positions whose outputs nobody reads: a scored
  // context, a prompt's chunks before its last.
  void fill_cache(const Batch& batch, KvCache& cache, Activations& acts, const int* cache_rows = nullptr);
  // forward_cached without a loss, and with the logits of each row's last new position only, in
  // the first B rows of acts.logits ([B, V]): a prompt's last chunk, whose other positions'
  // outputs nobody reads. The top block's attention, FFN and the head run on those B
  // positions alone (at 16,384 ids and d = 128 the head of every position was ~70 % of a
  // prompt's products; the top block's rest is 10 of a block's 12 d² a position).
  void forward_cached_last(const Batch& batch, KvCache& cache, Activations& acts,
                           const int* cache_rows = nullptr);
  // The same on the model's own activations (evaluation, tests, generation).
  void forward(const Batch& batch, float* token_loss, const float* loss_weight = nullptr) {
    forward(batch, *own_, token_loss, loss_weight);
  }
  void backward(const Batch& batch) { backward(batch, *own_); }
  // Row r of the logits of the last forward pass on the model's own activations ([B*T, V]),
  // downloaded to the host; only valid when it ran without loss weights.
  std::vector<float> logits_row(int64_t r) const;
  std::vector<float> logits() const;  // every row, [B*T, V]

  // Called during backward() with the pieces of the parameters whose gradients the pass has
  // finished (a stage of param_stages()), as it finishes them: the final LayerNorm after the head,
  // each block after its backward (top down), the embedding tables last. ZeRO-2 hands them to
  // their owners at once (train/train_step.cpp). Empty (the default): nothing is called.
  using GradsDone = std::function<void(const ParamStage&)>;
  void set_grads_done(GradsDone f) { grads_done_ = std::move(f); }
  // The parameters of each stage: [l] block l, [L] the final LayerNorm, [L + 1] the embedding
  // tables (the stages set_grads_done reports), then, in an RRE block whose experts are in the
  // model, each expert (expert_stages(l), in expert order: its slice of its group's stacked
  // tensors), so that a pass holds one expert's values and gradients at a time: block l's
  // stage is then its other tensors. Whole tensors elsewhere.
  const std::vector<ParamStage>& param_stages() const { return grad_stages_; }
  // Block l's expert stages (empty: a dense block, a learned gate's, or experts in a store).
  // A pass asks for them after block l's own stage and finishes them before it: the forward
  // expert by expert, backward likewise (each expert's gradients reported finished after its
  // backward, before the rest of the block's). Without hooks (set_params_needed,
  // set_grads_done) the experts run in one pass, side by side where that pays: the same bits.
  const std::vector<size_t>& expert_stages(int l) const { return expert_stages_[size_t(l)]; }
  // Called by a training forward() before it first reads a stage's parameters: stage L + 1
  // (the embeddings) first, then each block l, then L (the final LayerNorm before the tied
  // head); every stage at once, first, where bf16 copies of all weights are made. ZeRO's
  // overlapped gather (train/train_step.cpp) completes the stage's values there. Empty (the
  // default): nothing is called.
  // Backward calls it too: stages L and L + 1 before the head's backward, block l before its
  // (recomputed, under Remat::Blocks) backward. ZeRO-3 gathers the stage's values there.
  using ParamsNeeded = std::function<void(size_t stage)>;
  void set_params_needed(ParamsNeeded f) { params_needed_ = std::move(f); }
  // Called when a pass has read a stage's parameters for the last time in that pass: forward
  // after the embedding lookup (L + 1: the tied head asks for it again) and after each block;
  // backward after the head's backward (L, then L + 1) and after each block's. ZeRO-3
  // (train/train_step.cpp) releases the other ranks' values there. Empty: nothing is called.
  using ParamsDone = std::function<void(size_t stage)>;
  void set_params_done(ParamsDone f) { params_done_ = std::move(f); }

  // What backward recomputes instead of keeping (model/activations.h); default None.
  void set_remat(Remat r) { remat_ = r; }
  Remat remat() const { return remat_; }

  // The learned gate's weighted load-balancing loss of the last forward pass (0 with RRE).
  double aux_loss() const { return aux_loss_; }

  // Where RRE blocks run their experts; nullptr = on this process (LocalExperts). The
  // executor must outlive its use by the model.
  void set_expert_executor(ExpertExecutor* e) { executor_ = e ? e : &local_; }
  ExpertExecutor& expert_executor() { return *executor_; }

  // FLOPs of one forward+backward per token, by 6*(non-embedding params) + 6*V*d (head) +
  // 12*L*T*d (attention scores and values, causal savings not discounted).
  double train_flops_per_token() const;

  // Parameters one token's forward pass reads: every shared tensor, the V embedding rows of
  // its slot (the tied head scores against all of them) and one expert per RRE block (k with
  // a learned top-k gate, plus the gate of the widest group).
  int64_t active_params_per_token() const;

 private:
  // first_pos[b]: position of row b's first token (null = 0 for every row).
  void embed(const Batch& b, Activations& a, const int* first_pos);
  void mirror_weights(bool training);
  void mirror(const Activations& a, float* p, int64_t n) const;
  // recompute: a rerun under Remat::Blocks (load and auxiliary loss are not counted again).
  // With a cache, cache_rows[b] is batch row b's cache row (see forward_cached).
  // With a cache, a block may run in two parts: its keys and values alone (appended to the
  // cache), then, for the query layer only, the rest (its attention over the cache, output,
  // FFN) on rows of its own: a prompt's last chunk runs the rest on each row's last position.
  enum class BlockPart { All, KeysValues, Rest };
  void block_forward(int l, const Batch& b, Activations& a, KvCache* cache,
                     bool recompute = false, const int* cache_rows = nullptr,
                     BlockPart part = BlockPart::All);
  // What a cached pass computes after the keys and values: nothing (fill_cache), every new
  // position's logits (forward_cached), or each row's last position's (forward_cached_last).
  enum class Outputs { None, All, Last };
  void cached_pass(const Batch& batch, KvCache& cache, Activations& acts, float* token_loss,
                   const int* cache_rows, Outputs outputs);
  void append_kv(int l, const Batch& b, Activations& a, KvCache& cache, const int* cache_rows);
  // append: the batch's keys and values join the cache first (not when BlockPart::Rest).
  void cached_attention(int l, const Batch& b, Activations& a, KvCache& cache,
                        const int* cache_rows, kernels::AttnOperand q, float* att, bool append);
  void expert_forward(int l, const Batch& b, Activations& a, float* out, bool recompute);
  void head(const Batch& b, Activations& a, float* token_loss, const float* loss_weight);
  void head_backward(const Batch& b, Activations& a);
  void block_backward(int l, const Batch& b, Activations& a, float* dh);
  void expert_backward(int l, Activations& a, float* dh);
  void attention_backward(int l, const Batch& b, Activations& a, float* dh);

  Model(const ModelConfig& cfg, uint64_t seed, const TokenCounts* counts, bool external_experts,
        bool initialise, TpGroup tp, const InitOnly& init_only);

  ModelConfig cfg_;
  uint64_t seed_;
  bool external_experts_;
  TpGroup tp_;
  std::vector<ParamPiece> initialised_only_;
  bool mirrored_ = false;  // this forward registered bf16 copies (mirror_weights)
  ParamSet params_;
  BufferSet buffers_;
  std::vector<int> domain_group_;        // [domains]
  std::vector<std::string> unset_tables_;  // routing tables still waiting for load_buffer
  std::vector<BlockLoad> load_;
  double aux_loss_ = 0;
  Remat remat_ = Remat::None;
  std::unique_ptr<ModelWeights> w_;
  // use_weights: the copies by parameter name (device): values, and int8 scales. A bf16 or
  // int8 copy lies in arena_ (one tensor, its copies' start 2 MiB-aligned: huge pages); an fp32
  // one in its own tensor.
  struct WeightCopy {
    std::byte* data = nullptr;
    float* scale = nullptr;  // int8 only
    Tensor owned;            // fp32 only
  };
  std::map<std::string, WeightCopy> copies_;
  Tensor arena_;
  int64_t copy_bytes_ = 0;  // the copies' and scales' bytes (held_bytes; not the arena's padding)
  WeightFormat format_ = WeightFormat::F32;
  DType kv_dtype_ = DType::F32;
  bool inference_ = false;
  void attach_copies();
  std::unique_ptr<Activations> own_;
  // The parameters each stage of backward finishes: [l] block l, [L] the final LayerNorm,
  // [L + 1] the embedding tables.
  std::vector<ParamStage> grad_stages_;
  std::vector<std::vector<size_t>> expert_stages_;  // [l]: block l's expert stages
  GradsDone grads_done_;
  ParamsNeeded params_needed_;
  ParamsDone params_done_;
  bool staged() const { return params_needed_ || params_done_ || grads_done_; }
  void params_needed(size_t stage) const {
    if (params_needed_) params_needed_(stage);
  }
  void params_done(size_t stage) const {
    if (params_done_) params_done_(stage);
  }
  void grads_done(size_t stage) const {
    if (grads_done_ && !grad_stages_[stage].empty()) grads_done_(grad_stages_[stage]);
  }
  LocalExperts local_;
  ExpertExecutor* executor_ = &local_;
};

}  // namespace sigma
