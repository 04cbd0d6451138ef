#include "kernels/cpu/matmul.h"

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <unordered_map>

#include "core/bf16.h"
#include "core/error.h"
#include "kernels/cpu/bf16_vec.h"
#include "kernels/cpu/gemm.h"
#include "kernels/cpu/parallel.h"

namespace sigma::cpu {

namespace {

// oneDNN matmul primitives by shape and strides: creating one costs far more than a small
// product, and a training step repeats the same few dozen shapes. One cache per thread
// (primitives may run concurrently, but the map must not be shared).
// panels > 0: the fp32 product on that many column panels of B (matmul_f32_panels), N their
// columns; else a bf16 product.
struct MatmulKey {
  bool ta, tb, bias;
  int64_t M, N, K, lda, ldb, ldc;
  float alpha, beta;
  int64_t panels = 0;
  bool packed_b = false;  // B in the primitive's own layout (a packed copy of a mirror's B)
  auto tie() const {
    return std::tie(ta, tb, bias, M, N, K, lda, ldb, ldc, alpha, beta, panels, packed_b);
  }
  bool operator<(const MatmulKey& o) const { return tie() < o.tie(); }
};

dnnl::engine& engine() {
  static dnnl::engine e(dnnl::engine::kind::cpu, 0);
  return e;
}

struct Matmul {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul prim;
  dnnl::reorder pack;  // packed_b: B from its plain layout into pd.weights_desc()
};

// B[K, N] as stored (transposed: [N, K]).
dnnl::memory::desc plain_b_desc(const MatmulKey& k) {
  using dims = dnnl::memory::dims;
  return {{k.K, k.N}, dnnl::memory::data_type::bf16, k.tb ? dims{1, k.ldb} : dims{k.ldb, 1}};
}

// bf16 A[M, K] times B[K, N] (a transposed operand stored the other way round), fp32 C.
dnnl::matmul::desc bf16_desc(const MatmulKey& k) {
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  const dnnl::memory::desc a({k.M, k.K}, dt::bf16, k.ta ? dims{1, k.lda} : dims{k.lda, 1});
  const dnnl::memory::desc b = k.packed_b
                                   ? dnnl::memory::desc({k.K, k.N}, dt::bf16, dnnl::memory::format_tag::any)
                                   : plain_b_desc(k);
  const dnnl::memory::desc c({k.M, k.N}, dt::f32, dims{k.ldc, 1});
  if (!k.bias) return dnnl::matmul::desc(a, b, c);
  return dnnl::matmul::desc(a, b, dnnl::memory::desc({1, k.N}, dt::f32, dims{k.N, 1}), c);
}

// fp32: a batch of one A[M, K] (broadcast) times `panels` [K, 64] panels, each product written
// as columns 64 p.. of C: C's rows stay ldc apart, the panels 64 columns.
dnnl::matmul::desc panels_desc(const MatmulKey& k) {
  using dt = dnnl::memory::data_type;
  using dims = dnnl::memory::dims;
  const int64_t P = k.panels, W = kernels::kPanelColumns;
  const dnnl::memory::desc a({1, k.M, k.K}, dt::f32, dims{k.M * k.lda, k.lda, 1});
  const dnnl::memory::desc b({P, k.K, W}, dt::f32, dims{k.K * W, W, 1});
  const dnnl::memory::desc c({P, k.M, W}, dt::f32, dims{W, k.ldc, 1});
  return dnnl::matmul::desc(a, b, c);
}

Matmul make_matmul(const MatmulKey& k) {
  dnnl::primitive_attr attr;
  if (k.alpha != 1.0f) attr.set_output_scales(0, {k.alpha});
  if (k.beta != 0.0f) {
    dnnl::post_ops po;
    po.append_sum(k.beta);
    attr.set_post_ops(po);
  }
  dnnl::matmul::primitive_desc pd(k.panels ? panels_desc(k) : bf16_desc(k), attr, engine());
  Matmul m{pd, dnnl::matmul(pd), {}};
  if (k.packed_b)
    m.pack = dnnl::reorder(dnnl::reorder::primitive_desc(engine(), plain_b_desc(k), engine(), pd.weights_desc()));
  return m;
}

// Without native bf16 products: the same product in fp32 on the widened operands (a product of
// two bf16 values is exact in fp32, the sums are fp32 as oneDNN's bf16 path accumulates), so the
// same numerics with no speed-up, in per-thread scratch.
void matmul_widened(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, Bf16View A,
                    Bf16View B, float beta, float* C, int64_t ldc, const float* bias) {
  thread_local std::vector<float> a, b;
  auto widen = [](std::vector<float>& dst, Bf16View v, int64_t rows, int64_t cols) {
    dst.resize(size_t(rows * cols));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) dst[size_t(r * cols + c)] = sigma::from_bf16(v.p[r * v.ld + c]);
  };
  const int64_t a_cols = ta ? M : K, b_cols = tb ? K : N;
  widen(a, A, ta ? K : M, a_cols);
  widen(b, B, tb ? N : K, b_cols);
  gemm(ta, tb, M, N, K, alpha, a.data(), a_cols, b.data(), b_cols, beta, C, ldc);
  if (bias)
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] += bias[j];
}

struct ThreadMatmuls {
  std::map<MatmulKey, Matmul> cache;
  dnnl::stream stream{engine()};
};
thread_local ThreadMatmuls t_matmuls;

struct Mirror;
const void* packed_b(Mirror* m, const MatmulKey& key, Matmul& mm, const uint16_t* b,
                     dnnl::stream& stream);

// Runs the cached primitive for `key` (created on first use) on A, B and C (and bias); with
// key.packed_b, B is a view of mirror `from`, read through its packed copy (packed_b).
// A training step repeats a few dozen shapes, but prompts of every length reach the panels'
// products: past kMaxCached shapes a thread's cache starts again.
constexpr size_t kMaxCached = 512;
void run_matmul(const MatmulKey& key, const void* A, const void* B, float* C, const float* bias,
                Mirror* from = nullptr) {
  ThreadMatmuls& t = t_matmuls;
  auto it = t.cache.find(key);
  if (it == t.cache.end()) {
    if (t.cache.size() >= kMaxCached) t.cache.clear();
    try {
      it = t.cache.emplace(key, make_matmul(key)).first;
    } catch (const dnnl::error& e) {
      fail("oneDNN matmul {}x{}x{} (row strides {}, {}, {}; {} panels): {}", key.M, key.N, key.K,
                 key.lda, key.ldb, key.ldc, key.panels, e.what());
    }
  }
  const dnnl::matmul::primitive_desc& pd = it->second.pd;
  if (key.packed_b) B = packed_b(from, key, it->second, static_cast<const uint16_t*>(B), t.stream);
  dnnl::memory am(pd.src_desc(), engine(), const_cast<void*>(A)),
      bm(pd.weights_desc(), engine(), const_cast<void*>(B)), cm(pd.dst_desc(), engine(), C);
  std::unordered_map<int, dnnl::memory> args{
      {DNNL_ARG_SRC, am}, {DNNL_ARG_WEIGHTS, bm}, {DNNL_ARG_DST, cm}};
  if (bias)
    args[DNNL_ARG_BIAS] = dnnl::memory(pd.bias_desc(), engine(), const_cast<float*>(bias));
  it->second.prim.execute(t.stream, args);
  t.stream.wait();
}

// One row: sigma::to_bf16's bits, 16 lanes at a time (kernels/cpu/bf16_vec.h).
void row_to_bf16_impl(uint16_t* d, const float* s, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (; j + 16 <= n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + j), bf16x16(_mm512_loadu_ps(s + j)));
#endif
  for (; j < n; ++j) d[j] = sigma::to_bf16(s[j]);
}

// ---- the mirror ----
// A packed B: the view at `offset` in the mirror's copy, stored as `plain`, reordered into
// `packed` (a primitive's weights_desc()); its bytes 64-byte aligned inside, valid while fresh.
// Products of any row count that read the same view in the same layout share it, so a mirror
// holds one per layout whatever shapes train (a weight: its forward's and its data gradient's).
struct PackedB {
  int64_t offset;
  dnnl::memory::desc plain, packed;
  std::vector<uint8_t> bytes;
  bool fresh = false;
};
// A mirror's memory, kept as a spare for the next registration of the same range: its bf16
// copy and its packed copies.
struct MirrorBuffers {
  std::vector<uint16_t> data;
  std::vector<PackedB> packed;
};
struct Mirror {
  const float* p;
  int64_t n;
  MirrorBuffers buf;
  std::once_flag converted;
  std::mutex pack_mutex;
};
struct MirrorSet {
  std::vector<std::unique_ptr<Mirror>> live;   // sorted by p
  // Buffers to reuse: those of the last registration (live at its clear, or dropped during it).
  // A fresh one costs a zeroing pass and page faults (a step's activations: ~100 MB).
  std::map<std::pair<const float*, int64_t>, MirrorBuffers> spare;
  std::map<std::pair<const float*, int64_t>, MirrorBuffers> dropped;  // since the last clear
  std::atomic<int64_t> conversions{0};
  std::atomic<int64_t> packs{0};
  std::atomic<int64_t> allocations{0};
};

MirrorSet& mirrors() {
  static MirrorSet m;
  return m;
}

void* align64(std::vector<uint8_t>& v) {
  return reinterpret_cast<void*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
}

// B (a view of m's converted copy) in the layout of key's primitive: reordered on the first
// product of this registration that reads it so, then reused by every later one (a weight's
// forward products, or its data gradients' with the transposed layout).
const void* packed_b(Mirror* m, const MatmulKey& key, Matmul& mm, const uint16_t* b,
                     dnnl::stream& stream) {
  std::lock_guard<std::mutex> lock(m->pack_mutex);
  const int64_t offset = b - m->buf.data.data();
  const dnnl::memory::desc plain = plain_b_desc(key), packed = mm.pd.weights_desc();
  auto same = [&](const PackedB& p) { return p.offset == offset && p.plain == plain && p.packed == packed; };
  auto at = std::find_if(m->buf.packed.begin(), m->buf.packed.end(), same);
  if (at == m->buf.packed.end()) at = m->buf.packed.insert(at, PackedB{offset, plain, packed, {}, false});
  PackedB& pk = *at;
  if (!pk.fresh) {
    pk.bytes.resize(packed.get_size() + 64);
    dnnl::memory src(plain, engine(), const_cast<uint16_t*>(b)), dst(packed, engine(), align64(pk.bytes));
    mm.pack.execute(stream, src, dst);
    stream.wait();
    pk.fresh = true;
    mirrors().packs.fetch_add(1);
  }
  return align64(pk.bytes);
}

// The live mirror holding [src, src + extent), or null.
Mirror* find_mirror(const float* src, int64_t extent) {
  auto& live = mirrors().live;
  if (live.empty()) return nullptr;
  auto it = std::upper_bound(live.begin(), live.end(), src,
                             [](const float* p, const std::unique_ptr<Mirror>& m) { return p < m->p; });
  if (it == live.begin()) return nullptr;
  Mirror* m = (--it)->get();
  return src + extent <= m->p + m->n ? m : nullptr;
}

}  // namespace

// oneDNN's bf16 products need AVX-512 (native bf16 dot products or its
// emulation on avx512_core) or AMX; on an AVX2-only CPU (this project's Zen 3 machines) it
// cannot create the primitive. Asked once, with a small product.
bool native_bf16() {
  static const bool ok = [] {
    try {
      make_matmul({false, false, false, 2, 2, 2, 2, 2, 2, 1.0f, 0.0f});
      return true;
    } catch (const dnnl::error&) {
      return false;
    }
  }();
  return ok;
}

namespace {
// A weight gradient (A transposed: X^T dY, the reduction over a step's thousands of tokens)
// of up to 2048 rows, outside a parallel region, as two blocks of rows, each one product on one
// thread: oneDNN's team product on the whole (brgemm) splits it by columns, and each thread then
// copies all of X^T for itself; a block (oneDNN picks its older gemm kernels there) reads only
// its half. In the benchmark's step (Zen 5, DNNL_VERBOSE): the blocks 620-740 GFLOP/s against
// 550-625 whole; the tied head's 16 Ki rows gained nothing so, and stay whole. By shape only,
// and a block's product is one thread's whatever the team, so the bits do not depend on the
// thread count (they differ from the whole product's in the last place).
int64_t weight_gradient_parts(bool ta, int64_t M, int64_t K) {
  return ta && M >= 512 && M <= 2048 && K >= 1024 && !omp_in_parallel() ? 2 : 1;
}
}  // namespace

void matmul_bf16(bool ta, bool tb, int64_t M, int64_t N, int64_t K, float alpha, Bf16View A,
                 Bf16View B, float beta, float* C, int64_t ldc, const float* bias) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_c(M, N, beta, C, ldc);
  if (!native_bf16()) return matmul_widened(ta, tb, M, N, K, alpha, A, B, beta, C, ldc, bias);
  Mirror* from = static_cast<Mirror*>(const_cast<void*>(B.mirror));
  auto rows = [&](int64_t m0, int64_t m) {  // rows [m0, m0 + m) of C; A stored [K, M] when ta
    MatmulKey key{ta, tb, bias != nullptr, m, N, K, A.ld, B.ld, ldc, alpha, beta};
    key.packed_b = from != nullptr;
    run_matmul(key, A.p + (ta ? m0 : m0 * A.ld), B.p, C + m0 * ldc, bias, from);
  };
  const int64_t parts = weight_gradient_parts(ta, M, K);
  if (parts == 1) return rows(0, M);
  // Blocks of rows (multiples of 64), each one product on one thread, handed out in turn.
  const int64_t block = (M / parts + 63) / 64 * 64;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t p = 0; p < parts; ++p)
    if (p * block < M) rows(p * block, std::min(M, (p + 1) * block) - p * block);
}

void matmul_f32_panels(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda,
                       const float* B, float beta, float* C, int64_t ldc) {
  if (M == 0 || N == 0) return;
  if (K == 0) return scale_c(M, N, beta, C, ldc);
  const int64_t W = kernels::kPanelColumns, whole = N / W * W;
  if (whole > 0)
    run_matmul({false, false, false, M, whole, K, lda, W, ldc, 1.0f, beta, whole / W}, A, B, C, nullptr);
  if (whole < N)  // the last panel, [K, N - whole] row-major
    gemm(false, false, M, N - whole, K, 1.0f, A, lda, B + whole * K, N - whole, beta, C + whole, ldc);
}

void to_bf16(uint16_t* dst, int64_t ldd, const float* src, int64_t lds, int64_t rows,
             int64_t cols) {
  parallel_for(rows, rows * cols > (1 << 16) && !omp_in_parallel(),
               [&](int64_t i) { row_to_bf16_impl(dst + i * ldd, src + i * lds, cols); });
}

Bf16View bf16_operand(const float* src, int64_t rows, int64_t cols, int64_t ld,
                      std::vector<uint16_t>& buf) {
  if (rows > 0 && cols > 0) {
    if (Mirror* m = find_mirror(src, (rows - 1) * ld + cols)) {
      std::call_once(m->converted, [m] {
        // As rows of 16 Ki elements: to_bf16 splits a conversion by rows, and one row of the
        // whole range ran on one thread (dL/dlogits: 67 M elements).
        constexpr int64_t kRow = int64_t(1) << 14;
        const int64_t whole = m->n / kRow * kRow;
        to_bf16(m->buf.data.data(), kRow, m->p, kRow, whole / kRow, kRow);
        to_bf16(m->buf.data.data() + whole, 0, m->p + whole, 0, 1, m->n - whole);
        mirrors().conversions.fetch_add(1);
      });
      return {m->buf.data.data() + (src - m->p), ld, m};
    }
  }
  grow(buf, size_t(rows * cols));
  to_bf16(buf.data(), cols, src, ld, rows, cols);
  return {buf.data(), cols};
}

Bf16View bf16_operand_column_sums(const float* src, int64_t rows, int64_t cols, int64_t ld,
                                  std::vector<uint16_t>& buf, float* db) {
  if (rows > 0 && cols > 0 && find_mirror(src, (rows - 1) * ld + cols)) {
    column_sum_accumulate(db, src, rows, cols, ld);
    return bf16_operand(src, rows, cols, ld, buf);
  }
  // Fixed blocks of rows (whatever the thread count): each converts its rows and sums them
  // while they are in L1, then the blocks' sums are added in block order.
  constexpr int64_t kRows = 256;
  const int64_t blocks = (rows + kRows - 1) / kRows;
  grow(buf, size_t(rows * cols));
  thread_local std::vector<float> partial;
  partial.assign(size_t(blocks * cols), 0.0f);
  uint16_t* dst = buf.data();
  float* part = partial.data();
  parallel_for(blocks, !omp_in_parallel() && rows * cols > (1 << 16), [&](int64_t blk) {
    float* ps = part + blk * cols;
    for (int64_t i = blk * kRows; i < std::min(rows, (blk + 1) * kRows); ++i) {
      const float* row = src + i * ld;
      row_to_bf16_impl(dst + i * cols, row, cols);
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) ps[j] += row[j];
    }
  });
  for (int64_t blk = 0; blk < blocks; ++blk)
#pragma omp simd
    for (int64_t j = 0; j < cols; ++j) db[j] += part[blk * cols + j];
  return {buf.data(), cols};
}

void bf16_mirror_add(const float* p, int64_t n) {
  if (n <= 0) return;
  MirrorSet& ms = mirrors();
  auto m = std::make_unique<Mirror>();
  m->p = p;
  m->n = n;
  auto reuse = [&](auto& pool) {
    auto sp = pool.find({p, n});
    if (sp == pool.end()) return false;
    m->buf = std::move(sp->second);
    pool.erase(sp);
    for (PackedB& pk : m->buf.packed) pk.fresh = false;  // the values change: pack again
    return true;
  };
  if (!reuse(ms.spare) && !reuse(ms.dropped)) {
    m->buf.data.resize(size_t(n));
    ms.allocations.fetch_add(1);
  }
  auto at = std::lower_bound(ms.live.begin(), ms.live.end(), p,
                             [](const std::unique_ptr<Mirror>& x, const float* q) { return x->p < q; });
  // An overlapping range is left out: its products convert per call, as unregistered ones do.
  if (at != ms.live.end() && (*at)->p < p + n) return;
  if (at != ms.live.begin() && (*(at - 1))->p + (*(at - 1))->n > p) return;
  ms.live.insert(at, std::move(m));
}

void bf16_mirror_clear() {
  MirrorSet& ms = mirrors();
  // nothing registered since the last clear: keep the spares
  if (ms.live.empty() && ms.dropped.empty()) return;
  // Buffers of this registration become the spares of the next (unused spares are freed).
  ms.spare = std::move(ms.dropped);
  ms.dropped.clear();
  for (auto& m : ms.live) ms.spare[{m->p, m->n}] = std::move(m->buf);
  ms.live.clear();
}

void bf16_mirror_drop(const float* p) {
  MirrorSet& ms = mirrors();
  auto at = std::lower_bound(ms.live.begin(), ms.live.end(), p,
                             [](const std::unique_ptr<Mirror>& x, const float* q) { return x->p < q; });
  if (at == ms.live.end() || (*at)->p != p) return;
  ms.dropped[{(*at)->p, (*at)->n}] = std::move((*at)->buf);
  ms.live.erase(at);
}

uint16_t* bf16_mirror_claim(const float* p, int64_t n) {
  Mirror* m = n > 0 ? find_mirror(p, n) : nullptr;
  if (!m || m->p != p || m->n != n) return nullptr;
  bool claimed = false;  // call_once runs the lambda only where no product converted it yet
  std::call_once(m->converted, [&] { claimed = true; });
  return claimed ? m->buf.data.data() : nullptr;
}

void row_to_bf16(uint16_t* dst, const float* src, int64_t n) { row_to_bf16_impl(dst, src, n); }

int64_t bf16_mirror_conversions() { return mirrors().conversions.load(); }
int64_t bf16_mirror_packs() { return mirrors().packs.load(); }
int64_t bf16_mirror_allocations() { return mirrors().allocations.load(); }

}  // namespace sigma::cpu
