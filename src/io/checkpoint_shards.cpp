#include "io/checkpoint_shards.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/json_depth.h"
#include "io/checkpoint_dir.h"

namespace sigma {

namespace {

using nlohmann::json;

// One tensor being assembled from its pieces.
struct Assembly {
  TensorInfo whole;
  TensorPiece geometry;  // dim, parts, tp, experts: every piece's must agree
  std::string first_file;
  std::vector<std::pair<int64_t, int64_t>> ranges;  // [tp rank * experts + first, count)
  Tensor data;                                      // allocated when wanted
};

std::map<std::string, TensorPiece> parse_pieces(const Metadata& meta, const std::string& path) {
  std::map<std::string, TensorPiece> out;
  auto it = meta.find(kPiecesKey);
  if (it == meta.end()) return out;
  json j;
  try {
    j = json::parse(it->second, json_depth_limit(path));
  } catch (const json::exception& e) {
    fail("{}: metadata '{}' is not valid JSON: {}", path, kPiecesKey, e.what());
  }
  SIGMA_CHECK(j.is_object(), "{}: metadata '{}' is not an object", path, kPiecesKey);
  for (const auto& [name, v] : j.items()) {
    SIGMA_CHECK(v.is_array() && v.size() == 7 &&
                    std::all_of(v.begin(), v.end(), [](const json& x) { return x.is_number_integer(); }),
                "{}: piece of '{}' is not [dim, parts, tp, rank, first, count, experts]", path, name);
    TensorPiece p;
    p.dim = v[0].get<int>(), p.parts = v[1].get<int>(), p.tp = v[2].get<int>(), p.rank = v[3].get<int>();
    p.first = v[4].get<int64_t>(), p.count = v[5].get<int64_t>(), p.experts = v[6].get<int64_t>();
    out[name] = p;
  }
  return out;
}

// The whole shape of a piece of shape `s`, checked against its geometry.
Shape whole_shape(Shape s, const TensorPiece& p, const std::string& path, const std::string& name) {
  const bool ok = p.parts >= 1 && p.tp >= 1 && p.rank >= 0 && p.rank < p.tp &&
                  p.dim < int(s.size()) && (p.dim < 0 || s[size_t(p.dim)] % p.parts == 0) &&
                  (p.experts == 0 || (!s.empty() && p.first >= 0 && p.count == s[0] &&
                                      p.first + p.count <= p.experts && p.dim != 0));
  SIGMA_CHECK(ok, "{}: piece of tensor '{}' ({}) does not fit its geometry", path, name, shape_str(s));
  if (p.experts > 0) s[0] = p.experts;
  if (p.dim >= 0) s[size_t(p.dim)] *= p.tp;
  return s;
}

// Copies piece `src` (geometry p) into the whole tensor `dst` of shape `whole`.
void place(std::byte* dst, const std::byte* src, const Shape& whole, const TensorPiece& p, size_t es) {
  Shape sub = whole;  // the experts the piece covers
  int64_t base = 0;
  if (p.experts > 0) {
    base = p.first * (shape_numel(whole) / whole[0]);
    sub[0] = p.count;
  }
  dst += size_t(base) * es;
  if (p.dim < 0) {
    std::memcpy(dst, src, size_t(shape_numel(sub)) * es);
    return;
  }
  int64_t outer = 1, inner = 1;
  for (int i = 0; i < p.dim; ++i) outer *= sub[size_t(i)];
  for (size_t i = size_t(p.dim) + 1; i < sub.size(); ++i) inner *= sub[i];
  const int64_t D = sub[size_t(p.dim)], B = D / p.parts, b = B / p.tp;
  for (int64_t o = 0; o < outer; ++o)
    for (int64_t blk = 0; blk < p.parts; ++blk)
      std::memcpy(dst + size_t((o * D + blk * B + p.rank * b) * inner) * es,
                  src + size_t(((o * p.parts + blk) * b) * inner) * es, size_t(b * inner) * es);
}

// Every piece of `name` present exactly once: for each tp rank, expert ranges that tile
// [0, experts) (one piece when not split by experts).
void check_coverage(const std::string& dir, const std::string& name, Assembly& a, bool adam) {
  const int64_t E = std::max<int64_t>(a.geometry.experts, 1);
  std::sort(a.ranges.begin(), a.ranges.end());
  size_t i = 0;
  for (int r = 0; r < a.geometry.tp; ++r) {
    int64_t at = 0;
    while (at < E) {
      const int64_t want = int64_t(r) * E + at;
      SIGMA_CHECK(i < a.ranges.size() && a.ranges[i].first <= want,
                  "checkpoint '{}': tensor '{}' lacks its piece for tp slice {} of {}{} (in none "
                  "of the shard-*.{}.safetensors files)", dir, name, r, a.geometry.tp,
                  a.geometry.experts ? fmt::format(", expert {} of {}", at, E) : "",
                  adam ? "adam" : "model");
      SIGMA_CHECK(a.ranges[i].first == want, "checkpoint '{}': tensor '{}' has overlapping pieces "
                  "(tp slice {}, expert {})", dir, name, r, at);
      at += std::max<int64_t>(a.ranges[i].second, 1);
      ++i;
    }
  }
  SIGMA_CHECK(i == a.ranges.size(), "checkpoint '{}': tensor '{}' has {} pieces, {} more than "
              "its geometry holds", dir, name, a.ranges.size(), a.ranges.size() - i);
}

}  // namespace

std::string shard_file(int index, bool adam) {
  return fmt::format("shard-{:04d}.{}.safetensors", index, adam ? "adam" : "model");
}

std::string pieces_metadata(const std::map<std::string, TensorPiece>& pieces) {
  json j = json::object();
  for (const auto& [name, p] : pieces)
    j[name] = {p.dim, p.parts, p.tp, p.rank, p.first, p.count, p.experts};
  return j.dump();
}

bool is_sharded_checkpoint(const std::string& dir) {
  std::error_code ec;  // a bare directory of files (no manifest) holds whole tensors
  if (!std::filesystem::exists(std::filesystem::path(dir) / kManifestFile, ec)) return false;
  return !sharded_files(dir, false).empty();
}

std::vector<std::string> sharded_files(const std::string& dir, bool adam) {
  std::vector<std::string> out;
  const std::string tail = adam ? ".adam.safetensors" : ".model.safetensors";
  for (const auto& [file, e] : read_manifest(dir))  // sorted by name: rank order
    if (file.starts_with("shard-") && file.ends_with(tail)) out.push_back(file);
  return out;
}

Safetensors read_sharded(const std::string& dir, bool adam,
                         const std::function<bool(const std::string&)>& want) {
  std::map<std::string, Assembly> all;
  Safetensors out;
  for (const std::string& file : sharded_files(dir, adam)) {
    const std::string path = dir + "/" + file;
    Safetensors st = read_safetensors(path, want);
    const auto pieces = parse_pieces(st.metadata, path);
    if (out.metadata.empty()) out.metadata = st.metadata;
    for (const auto& [name, info] : st.index) {
      auto pit = pieces.find(name);
      const TensorPiece p = pit == pieces.end() ? TensorPiece{} : pit->second;
      const Shape whole = whole_shape(info.shape, p, path, name);
      auto [it, fresh] = all.try_emplace(name);
      Assembly& a = it->second;
      if (fresh) {
        a.whole = {info.dtype, whole};
        a.geometry = p;
        a.first_file = file;
      }
      SIGMA_CHECK(a.whole.dtype == info.dtype && a.whole.shape == whole && a.geometry.dim == p.dim &&
                      a.geometry.parts == p.parts && a.geometry.tp == p.tp &&
                      a.geometry.experts == p.experts,
                  "checkpoint '{}': tensor '{}' is pieced differently in {} ({} {}) and {} ({} {})",
                  dir, name, a.first_file, dtype_name(a.whole.dtype), shape_str(a.whole.shape), file,
                  dtype_name(info.dtype), shape_str(whole));
      a.ranges.emplace_back(int64_t(p.rank) * std::max<int64_t>(p.experts, 1) + p.first, p.count);
      auto t = st.tensors.find(name);
      if (t == st.tensors.end()) continue;
      if (a.data.numel() == 0 && shape_numel(whole) > 0) a.data = Tensor(info.dtype, whole, Device::Host);
      place(a.data.bytes(), t->second.bytes(), whole, p, dtype_size(info.dtype));
      st.tensors.erase(t);  // its bytes are in the whole one now
    }
  }
  for (auto& [name, a] : all) {
    check_coverage(dir, name, a, adam);
    out.index.emplace(name, a.whole);
    if (!want || want(name)) out.tensors.emplace(name, a.data.numel() ? std::move(a.data)
                                                                     : Tensor(a.whole.dtype, a.whole.shape, Device::Host));
  }
  return out;
}

std::string TensorSource::label() const {
  if (!path.empty()) return path;
  return fmt::format("{}/shard-*.{}.safetensors", sharded_dir, adam ? "adam" : "model");
}

bool TensorSource::exists() const {
  if (!path.empty()) return std::filesystem::exists(path);
  return !sharded_files(sharded_dir, adam).empty();
}

Safetensors TensorSource::read(const std::function<bool(const std::string&)>& want) const {
  if (!path.empty()) return read_safetensors(path, want);
  return read_sharded(sharded_dir, adam, want);
}

}  // namespace sigma
