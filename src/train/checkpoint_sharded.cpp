#include "train/checkpoint_sharded.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <numeric>
#include <optional>

#include "core/error.h"
#include "io/checkpoint_dir.h"
#include "io/checkpoint_shards.h"
#include "kernels/ops.h"
#include "model/tensor_parallel.h"
#include "train/checkpoint.h"

namespace sigma {

namespace shard_save {

// A tensor's bytes on the host: as it is, or downloaded into `keep` (deque: stable addresses).
TensorRef host_view(std::string name, const Tensor& t, std::deque<Tensor>& keep) {
  if (t.device() == Device::Host) return tensor_ref(std::move(name), t);
  keep.push_back(ops::to_host(t));
  return tensor_ref(std::move(name), keep.back());
}

// Who writes what. Each tp-split parameter's slices go to one data rank (every tp rank writes
// its slice there); each replicated one to one (data rank, tp rank) pair; both dealt largest
// first to the least loaded, from shapes alone, so every rank computes the same deal.
// Adam state stays with its ZeRO owner; a replicated parameter's goes to tp rank
// `adam_tp[i]` of its owner (dealt alike over the tp ranks).
struct Deal {
  std::vector<int> data_rank, tp_rank, adam_tp;  // [params]; tp_rank -1: every tp rank (split)
};

// `base`: what each rank (data rank * P + tp rank) writes anyway, in elements (its experts,
// its Adam shard, its rows of the tensors ZeRO cut), so that the weights even out the ranks'
// files. `cut` ([params]): ZeRO cut it over the data ranks, whose owners write their rows.
Deal deal(const Model& model, int D, int P, std::vector<double> load, const std::vector<uint8_t>& cut) {
  const auto& ps = model.params().all();
  const size_t n = ps.size();
  Deal d{std::vector<int>(n, 0), std::vector<int>(n, -1), std::vector<int>(n, 0)};
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t(0));
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return ps[a].value.numel() > ps[b].value.numel(); });
  std::vector<double> adam_load(size_t(P), 0);
  const bool split_model = P > 1;
  auto replicated = [&](size_t i) { return !split_model || tp_split(model.config(), ps[i].name).replicated(); };
  for (size_t i : order) {  // the split ones: one data rank (the least loaded), every tp rank alike
    if (replicated(i)) continue;
    int best = 0;
    double best_load = 0;
    for (int r = 0; r < D; ++r) {
      double l = 0;
      for (int t = 0; t < P; ++t) l += load[size_t(r * P + t)];
      if (r == 0 || l < best_load) best = r, best_load = l;
    }
    d.data_rank[i] = best;
    for (int t = 0; t < P; ++t) load[size_t(best * P + t)] += double(ps[i].value.numel());
  }
  for (size_t i : order) {  // the replicated ones: one (data rank, tp rank)
    if (!replicated(i)) continue;
    if (!cut[i]) {
      const size_t b = size_t(std::min_element(load.begin(), load.end()) - load.begin());
      d.data_rank[i] = int(b / size_t(P));
      d.tp_rank[i] = int(b % size_t(P));
      load[b] += double(ps[i].value.numel());
    }
    const size_t a = size_t(std::min_element(adam_load.begin(), adam_load.end()) - adam_load.begin());
    d.adam_tp[i] = int(a);
    adam_load[a] += double(ps[i].value.numel());
  }
  return d;
}

// Elements of the tensors in `refs` (whole ones or pieces).
double elements(const std::vector<TensorRef>& refs) {
  double n = 0;
  for (const TensorRef& r : refs) n += double(shape_numel(r.shape));
  return n;
}

// Rows [first, first + count) of t on the host, as a tensor of `count` rows.
TensorRef host_rows(std::string name, const Tensor& t, int64_t first, int64_t count,
                    std::deque<Tensor>& keep) {
  Shape rows = t.shape();
  const size_t row_bytes = t.nbytes() / size_t(rows[0]);
  rows[0] = count;
  const size_t at = size_t(first) * row_bytes;
  if (t.device() == Device::Host) return {std::move(name), t.dtype(), rows, t.bytes() + at};
  keep.emplace_back(t.dtype(), rows, Device::Host);
  ops::download(keep.back().bytes(), t.dev_bytes() + at, size_t(count) * row_bytes);
  return tensor_ref(std::move(name), keep.back());
}

// This rank's weight and Adam pieces of the model's parameters. A tensor ZeRO cuts into row
// runs (parallel/shard_plan.h) goes as each owner's rows: a piece along dim 0.
void add_params(ShardContents& out, const Model& model, const AdamW* opt, const Deal& deal,
                const std::vector<uint8_t>& cut, int data_rank, int tp_rank, int P, bool values_owned) {
  const auto& ps = model.params().all();
  for (size_t i = 0; i < ps.size(); ++i) {
    const TpSplit s = P > 1 ? tp_split(model.config(), ps[i].name) : TpSplit{};
    const bool split = !s.replicated();
    const TensorPiece tp_piece = split ? TensorPiece{s.dim, s.parts, P, tp_rank, 0, 0, 0} : TensorPiece{};
    const bool part = opt && opt->owns_part(i);  // never a tp slice (trainer.cpp)
    TensorPiece rows_piece;  // this rank's rows of a tensor ZeRO cut
    if (part) {
      rows_piece.experts = ps[i].value.dim(0);
      rows_piece.first = opt->first_row(i);
      rows_piece.count = opt->owned(i).size() / (ps[i].value.numel() / rows_piece.experts);
    }
    // t holds the whole parameter's rows (a value) or, when `owned_rows`, this rank's only.
    auto add = [&](std::vector<TensorRef>& refs, std::map<std::string, TensorPiece>& pieces,
                   std::string name, const Tensor& t, bool owned_rows) {
      if (part) pieces[name] = rows_piece;
      else if (split) pieces[name] = tp_piece;
      refs.push_back(part && !owned_rows
                         ? host_rows(std::move(name), t, rows_piece.first, rows_piece.count, out.keep)
                         : host_view(std::move(name), t, out.keep));
    };
    // dist.zero = 3 (values_owned): each value with its ZeRO owner, the only rank holding it;
    // a tensor ZeRO cut: each owner its rows, at every stage. Otherwise one rank writes it whole.
    const bool with_owner = values_owned || cut[i];
    const bool mine = with_owner ? opt->owns(i) && (split || deal.adam_tp[i] == tp_rank)
                                 : deal.data_rank[i] == data_rank && (split || deal.tp_rank[i] == tp_rank);
    if (mine) add(out.model, out.model_pieces, ps[i].name, ps[i].value, false);
    if (!opt || !opt->owns(i)) continue;
    const auto& st = opt->state()[i];
    if (split || deal.adam_tp[i] == tp_rank)  // m and v hold the owned rows only
      for (auto [suffix, t] : {std::pair{".m", &st.m}, std::pair{".v", &st.v}})
        add(out.adam, out.adam_pieces, ps[i].name + suffix, *t, true);
    if (deal.adam_tp[i] != tp_rank) continue;
    if (!st.row_step.empty()) {  // lazy rows (not with tp: optim.sparse_embeddings is refused)
      out.keep.emplace_back(DType::I64, Shape{int64_t(st.row_step.size())});
      std::copy(st.row_step.begin(), st.row_step.end(), out.keep.back().data<int64_t>());
      add(out.adam, out.adam_pieces, ps[i].name + ".row_steps", out.keep.back(), true);
    }
    if (part && rows_piece.first != 0) continue;  // the step count once, by the first rows' owner
    out.keep.emplace_back(DType::I64, Shape{});
    *out.keep.back().data<int64_t>() = st.step;
    out.adam.push_back(tensor_ref(ps[i].name + ".step", out.keep.back()));
  }
}

// Sizes and checksums of a rank's two files and whether it wrote them, as exact doubles.
constexpr size_t kRecord = 9;
void put(double* v, uint64_t x) { v[0] = double(x >> 32), v[1] = double(x & 0xffffffffu); }
uint64_t get(const double* v) { return (uint64_t(v[0]) << 32) | uint64_t(v[1]); }

// Every rank of the run reaches it before any leaves (the tp groups, then the data groups:
// each tp group holds one member of every data group).
void world_barrier(Communicator& data, Communicator& tp) {
  tp.barrier();
  data.barrier();
}

}  // namespace shard_save

std::unique_ptr<ShardedSave> begin_sharded_save(const std::string& root, Config& cfg,
                                                const Model& model, const AdamW* opt,
                                                const TrainerState& st, ExpertFiles* experts,
                                                Communicator& data, Communicator& tp) {
  using namespace shard_save;
  auto s = std::make_unique<ShardedSave>();
  const int D = data.size(), P = tp.size(), dr = data.rank(), tr = tp.rank();
  s->root = root, s->name = checkpoint_name(st.step);
  s->ranks = D * P, s->tp = P, s->index = dr * P + tr;
  s->lead = s->index == 0;
  s->adam = opt != nullptr;
  s->record.assign(kRecord, 0.0);
  ShardContents& mine = s->mine;  // views and copies only: no file yet
  if (experts) experts->add_shard_tensors(mine);  // a collective over the data group
  // What each rank writes before the weights are dealt: its experts and its Adam shard.
  double base = elements(mine.model) + elements(mine.adam);
  const size_t n = model.params().all().size();
  std::vector<double> cut_by(n, 0.0);  // ranks owning part of param i: > 0 where ZeRO cut it
  for (size_t i = 0; opt && i < n; ++i) {
    cut_by[i] = opt->owns_part(i);
    base += (cut_by[i] ? 3.0 : 2.0) * double(opt->owned(i).size());  // a cut one: its value rows too
  }
  data.all_reduce_sum(cut_by.data(), int64_t(n));
  std::vector<uint8_t> cut(n);
  for (size_t i = 0; i < n; ++i) cut[i] = cut_by[i] > 0;
  std::vector<double> bases(static_cast<size_t>(P)), all_bases(static_cast<size_t>(s->ranks));
  tp.all_gather(bases.data(), &base, 1);
  data.all_gather(all_bases.data(), bases.data(), size_t(P));  // rank i's at i
  // dist.zero = 3: a rank holds only the values it owns between steps (train/train_step.h),
  // so each goes with its Adam state (the deal's tp rank for a replicated one) instead.
  const bool values_owned = cfg.dist.zero == 3 && D > 1;
  SIGMA_CHECK(!values_owned || opt, "a dist.zero = 3 save needs the optimizer (who owns what)");
  add_params(mine, model, opt, deal(model, D, P, std::move(all_bases), cut), cut, dr, tr, P, values_owned);
  if (s->lead)
    for (const Buffer& b : model.buffers().all()) mine.model.push_back(tensor_ref(b.name, b.value));
  s->config = cfg.to_json();

  try {
    if (s->lead) {
      s->writer.emplace(root, s->name);
      s->writer->set_sharded();
      s->tmp = s->writer->temp_dir();
    }
  } catch (const std::exception& e) {
    s->error = e.what();
  }
  // The temporary directory's path, from the lead: over tp rank 0's data group, then each tp group.
  for (Communicator* c : {&data, &tp}) {
    uint64_t n = s->tmp.size();
    c->broadcast(&n, sizeof n, 0);
    s->tmp.resize(size_t(n));
    c->broadcast(s->tmp.data(), size_t(n), 0);
  }
  if (s->tmp.empty() && s->error.empty()) s->error = "the checkpoint's temporary directory was not made";
  return s;
}

void write_sharded_files(ShardedSave& s, const std::function<void(CheckpointWriter&)>& files) {
  using namespace shard_save;
  if (s.tmp.empty()) return;
  try {
    if (!s.lead) s.writer.emplace(CheckpointWriter::peer(s.tmp));
    files(*s.writer);
    const auto [ms, mx] = s.writer->recorded(shard_file(s.index, false));
    put(&s.record[1], ms), put(&s.record[3], mx);
    if (s.adam) {
      const auto [as, ax] = s.writer->recorded(shard_file(s.index, true));
      put(&s.record[5], as), put(&s.record[7], ax);
    }
    s.record[0] = 1;
  } catch (const std::exception& e) {
    s.error = e.what();
  }
}

std::string finish_sharded_save(std::unique_ptr<ShardedSave> s, ExpertFiles* experts,
                                Communicator& data, Communicator& tp) {
  using namespace shard_save;
  const int R = s->ranks, P = s->tp, index = s->index;
  const bool lead = s->lead;
  const std::string& name = s->name;
  std::string& error = s->error;
  // Every rank's record to every rank: tp group first, then the data group over those.
  std::vector<double> group(kRecord * size_t(P)), all(kRecord * size_t(R));
  tp.all_gather(group.data(), s->record.data(), kRecord);
  data.all_gather(all.data(), group.data(), kRecord * size_t(P));  // rank i's at i * kRecord
  int failed = -1;
  for (int i = 0; i < R && failed < 0; ++i)
    if (all[size_t(i) * kRecord] != 1) failed = i;
  if (failed >= 0) {
    if (!error.empty())
      fail("checkpoint {} was not saved: this rank (shard {}) could not write its files: {}; the "
           "checkpoints committed before it are intact", name, index, error);
    fail("checkpoint {} was not saved: the rank writing shard {} of {} (data rank {}, tp rank {}) "
         "could not write its files {} or {} (its own message says why); the checkpoints committed "
         "before it are intact", name, failed, R, failed / P, failed % P, shard_file(failed, false),
         shard_file(failed, true));
  }
  double committed = 0;
  std::string dir = (std::filesystem::path(s->root) / name).string();
  if (lead) {
    try {
      for (int i = 1; i < R; ++i) {
        const double* r = all.data() + size_t(i) * kRecord;
        s->writer->add_peer_file(shard_file(i, false), get(r + 1), get(r + 3));
        if (s->adam) s->writer->add_peer_file(shard_file(i, true), get(r + 5), get(r + 7));
      }
      dir = s->writer->commit();  // the manifest names every rank's files, then the rename, then latest
      committed = 1;
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  for (Communicator* c : {&data, &tp}) c->broadcast(&committed, sizeof committed, 0);
  if (committed != 1) {
    if (lead) fail("checkpoint {} was not saved: {}; the checkpoints committed before it are "
                   "intact", name, error);
    fail("checkpoint {} was not saved: its commit failed (data rank 0, tp rank 0 says why); the "
         "checkpoints committed before it are intact", name);
  }
  if (experts) experts->checkpoint_written(dir);
  return dir;
}

std::string save_sharded_checkpoint(const std::string& root, Config& cfg, const Model& model,
                                    const AdamW* opt, const TrainerState& st,
                                    const std::string& tokenizer_path, ExpertFiles* experts,
                                    Communicator& data, Communicator& tp) {
  std::unique_ptr<ShardedSave> s = begin_sharded_save(root, cfg, model, opt, st, experts, data, tp);
  ShardedSave& me = *s;
  // Ranks write in waves of dist.ckpt_writers, so that R ranks do not all hit the disk at once.
  const int writers = std::max(1, cfg.dist.ckpt_writers);
  for (int wave = 0; wave * writers < me.ranks; ++wave) {
    if (me.index / writers == wave)
      write_sharded_files(me, [&](CheckpointWriter& w) {
        add_shard_files(w, me);
        if (me.lead) add_run_files(w, cfg, st, tokenizer_path);
      });
    shard_save::world_barrier(data, tp);
  }
  me.mine = {};  // the copies are on disk now
  return finish_sharded_save(std::move(s), experts, data, tp);
}

}  // namespace sigma
