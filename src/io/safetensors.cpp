#include "io/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>

#include "io/file.h"

namespace sigma {
namespace {

using nlohmann::json;


// numel * dtype_size, or false when a dimension is negative or the size overflows. Zero
// dimensions are skipped while multiplying so that [2^62, 2^62, 0] cannot overflow either.
bool byte_size(const Shape& shape, DType dt, uint64_t* out) {
  int64_t n = 1;
  bool zero = false;
  for (int64_t d : shape) {
    if (d < 0) return false;
    if (d == 0) zero = true;
    else if (__builtin_mul_overflow(n, d, &n)) return false;
  }
  uint64_t bytes;
  if (__builtin_mul_overflow(static_cast<uint64_t>(n), dtype_size(dt), &bytes)) return false;
  *out = zero ? 0 : bytes;
  return true;
}

// --- header parsing -------------------------------------------------------------------

// One open JSON object while parsing: its keys so far, to reject duplicates that nlohmann
// would otherwise silently collapse (last one wins), and the key it sits under.
struct OpenObject {
  std::string under;
  std::string last_key;
  std::set<std::string> keys;
};

json parse_header(const std::string& text, const std::string& where) {
  std::vector<OpenObject> stack;
  // Legit headers nest three deep (object > entry > shape array); anything deeper is
  // rejected as it starts, so a hostile "[[[[..." costs nothing.
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        if (depth > 2) fail("{}: header nests deeper than a safetensors header can", where);
        if (ev == json::parse_event_t::object_start)
          stack.push_back({stack.empty() ? "" : stack.back().last_key, "", {}});
        break;
      case json::parse_event_t::key: {
        OpenObject& o = stack.back();
        std::string k = parsed.get<std::string>();
        if (!o.keys.insert(k).second) {
          if (stack.size() == 1) fail("{}: duplicate tensor name '{}'", where, k);
          fail("{}: duplicate key '{}' in '{}'", where, k, o.under);
        }
        o.last_key = std::move(k);
        break;
      }
      case json::parse_event_t::object_end:
        stack.pop_back();
        break;
      default:
        break;
    }
    return true;
  };
  try {
    return json::parse(text, cb);
  } catch (const json::exception& e) {
    fail("{}: header is not valid JSON: {}", where, e.what());
  }
}

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

uint64_t as_u64(const json& v, const std::string& where, const std::string& name,
                const char* field) {
  if (!v.is_number_unsigned())
    fail("{}: tensor '{}': {} must hold non-negative integers, found {}", where, name, field,
         v.dump());
  return v.get<uint64_t>();
}

Entry parse_entry(const std::string& name, const json& v, const std::string& where) {
  if (!v.is_object())
    fail("{}: tensor '{}': entry must be an object with dtype, shape and data_offsets", where,
         name);
  for (const auto& [k, _] : v.items())
    if (k != "dtype" && k != "shape" && k != "data_offsets")
      fail("{}: tensor '{}': unknown field '{}'", where, name, k);
  auto dt = v.find("dtype"), sh = v.find("shape"), of = v.find("data_offsets");
  if (dt == v.end() || !dt->is_string())
    fail("{}: tensor '{}': missing or non-string \"dtype\"", where, name);
  if (sh == v.end() || !sh->is_array())
    fail("{}: tensor '{}': missing or non-array \"shape\"", where, name);
  if (of == v.end() || !of->is_array() || of->size() != 2)
    fail("{}: tensor '{}': \"data_offsets\" must be [begin, end]", where, name);

  Entry e{name, DType::F32, {}, 0, 0};
  try {
    e.dtype = dtype_from_name(dt->get<std::string>());
  } catch (const Error& err) {
    fail("{}: tensor '{}': {}", where, name, err.what());
  }
  for (const json& d : *sh) {
    uint64_t u = as_u64(d, where, name, "shape");
    if (u > uint64_t(std::numeric_limits<int64_t>::max()))
      fail("{}: tensor '{}': dimension {} is too large", where, name, u);
    e.shape.push_back(static_cast<int64_t>(u));
  }
  e.begin = as_u64((*of)[0], where, name, "data_offsets");
  e.end = as_u64((*of)[1], where, name, "data_offsets");
  if (e.begin > e.end)
    fail("{}: tensor '{}': data_offsets [{}, {}] end before they begin", where, name, e.begin,
         e.end);
  uint64_t need;
  if (!byte_size(e.shape, e.dtype, &need))
    fail("{}: tensor '{}': shape {} is too large", where, name, shape_str(e.shape));
  if (e.end - e.begin != need)
    fail("{}: tensor '{}': data_offsets [{}, {}] hold {} bytes but {} {} needs {}", where, name,
         e.begin, e.end, e.end - e.begin, dtype_name(e.dtype), shape_str(e.shape), need);
  return e;
}

Metadata parse_metadata(const json& v, const std::string& where) {
  if (!v.is_object()) fail("{}: \"__metadata__\" must be an object of strings", where);
  Metadata m;
  for (const auto& [k, val] : v.items()) {
    if (!val.is_string())
      fail("{}: metadata key '{}' must map to a string, found {}", where, k, val.type_name());
    m[k] = val.get<std::string>();
  }
  return m;
}

// Tensors must tile the buffer exactly, as the reference implementation requires: overlap
// would alias two tensors, and gaps or trailing bytes mean the header and data disagree.
void check_layout(std::vector<Entry>& es, uint64_t buffer, const std::string& where) {
  std::sort(es.begin(), es.end(), [](const Entry& a, const Entry& b) {
    return std::tie(a.begin, a.end) < std::tie(b.begin, b.end);
  });
  uint64_t at = 0;
  const Entry* prev = nullptr;
  for (const Entry& e : es) {
    if (e.end > buffer)
      fail("{}: tensor '{}': data_offsets [{}, {}] run past the {}-byte data buffer "
           "(truncated file?)", where, e.name, e.begin, e.end, buffer);
    if (e.begin < at)
      fail("{}: tensor '{}': data_offsets [{}, {}] overlap tensor '{}' [{}, {}]", where, e.name,
           e.begin, e.end, prev->name, prev->begin, prev->end);
    if (e.begin > at)
      fail("{}: tensor '{}': {} unused bytes before its data_offsets [{}, {}]", where, e.name,
           e.begin - at, e.begin, e.end);
    at = e.end;
    prev = &e;
  }
  if (at != buffer)
    fail("{}: {} bytes after the last tensor are not described by the header", where,
         buffer - at);
}

}  // namespace

std::vector<TensorRef> tensor_refs(const TensorMap& m) {
  std::vector<TensorRef> r;
  r.reserve(m.size());
  for (const auto& [name, t] : m) r.push_back(tensor_ref(name, t));
  return r;
}

void write_safetensors(const std::string& path, const std::vector<TensorRef>& tensors,
                       const Metadata& meta) {
  std::vector<const TensorRef*> order;
  for (const TensorRef& t : tensors) order.push_back(&t);
  std::sort(order.begin(), order.end(),
            [](const TensorRef* a, const TensorRef* b) { return a->name < b->name; });

  json header = json::object();
  std::vector<uint64_t> sizes;
  uint64_t off = 0;
  for (size_t i = 0; i < order.size(); ++i) {
    const TensorRef& t = *order[i];
    SIGMA_CHECK(!t.name.empty() && t.name != "__metadata__",
                "cannot write '{}': invalid tensor name '{}'", path, t.name);
    SIGMA_CHECK(i == 0 || order[i - 1]->name != t.name,
                "cannot write '{}': tensor name '{}' appears twice", path, t.name);
    uint64_t nb;
    SIGMA_CHECK(byte_size(t.shape, t.dtype, &nb), "cannot write '{}': tensor '{}' has shape {}",
                path, t.name, shape_str(t.shape));
    SIGMA_CHECK(nb == 0 || t.data || !t.parts.empty(), "cannot write '{}': tensor '{}' has no data",
                path, t.name);
    SIGMA_CHECK(t.parts.empty() || nb % t.parts.size() == 0,
                "cannot write '{}': tensor '{}' of {} bytes cannot be split into {} equal parts",
                path, t.name, nb, t.parts.size());
    header[t.name] = {{"dtype", dtype_name(t.dtype)},
                      {"shape", t.shape},
                      {"data_offsets", json::array({off, off + nb})}};
    sizes.push_back(nb);
    off += nb;
  }
  if (!meta.empty()) header["__metadata__"] = meta;

  std::string text;
  try {
    text = header.dump();
  } catch (const json::exception& e) {
    fail("cannot write '{}': tensor names and metadata must be valid UTF-8 ({})", path,
         e.what());
  }
  // Padding keeps the data buffer 8-byte aligned when the file is memory-mapped.
  text.append((8 - text.size() % 8) % 8, ' ');
  std::string head(8, '\0');
  for (int i = 0; i < 8; ++i) head[i] = static_cast<char>((uint64_t(text.size()) >> (8 * i)) & 0xff);
  head += text;

  Fd f(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
  SIGMA_CHECK(f.fd >= 0, "cannot create '{}': {}", path, errno_str());
  try {
    write_all(f.fd, head.data(), head.size(), path);
    for (size_t i = 0; i < order.size(); ++i) {
      const TensorRef& t = *order[i];
      if (t.parts.empty()) write_all(f.fd, t.data, sizes[i], path);
      for (const void* part : t.parts) write_all(f.fd, part, sizes[i] / t.parts.size(), path);
    }
    SIGMA_CHECK(::fsync(f.fd) == 0, "cannot fsync '{}': {}", path, errno_str());
    f.close_checked(path);
  } catch (...) {
    ::unlink(path.c_str());
    throw;
  }
}

Safetensors read_safetensors(const std::string& path,
                             const std::function<bool(const std::string&)>& want) {
  const std::string where = fmt::format("safetensors file '{}'", path);
  Fd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  SIGMA_CHECK(f.fd >= 0, "cannot open {}: {}", where, errno_str());
  struct stat st;
  SIGMA_CHECK(::fstat(f.fd, &st) == 0, "cannot stat {}: {}", where, errno_str());
  SIGMA_CHECK(S_ISREG(st.st_mode), "{}: not a regular file", where);
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  SIGMA_CHECK(size >= 8, "{}: truncated: {} bytes is shorter than the 8-byte length prefix",
              where, size);

  unsigned char len[8];
  read_at(f.fd, len, 8, 0, where);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(len[i]) << (8 * i);
  SIGMA_CHECK(n <= kSafetensorsMaxHeader, "{}: header length {} exceeds the {}-byte limit "
              "(not a safetensors file, or corrupt)", where, n, kSafetensorsMaxHeader);
  SIGMA_CHECK(n <= size - 8, "{}: header length {} runs past the end of the {}-byte file "
              "(truncated?)", where, n, size);
  std::string text(n, '\0');
  read_at(f.fd, text.data(), n, 8, where);

  const json header = parse_header(text, where);
  SIGMA_CHECK(header.is_object(), "{}: header must be a JSON object", where);
  Safetensors out;
  std::vector<Entry> entries;
  for (const auto& [key, val] : header.items()) {
    if (key == "__metadata__") out.metadata = parse_metadata(val, where);
    else entries.push_back(parse_entry(key, val, where));
  }
  const uint64_t data_start = 8 + n;
  check_layout(entries, size - data_start, where);

  for (Entry& e : entries) {  // sorted by offset: one sequential pass over the file
    out.index[e.name] = {e.dtype, e.shape};
    if (want && !want(e.name)) continue;
    Tensor t(e.dtype, std::move(e.shape));
    read_at(f.fd, t.bytes(), t.nbytes(), data_start + e.begin, where);
    out.tensors.emplace(std::move(e.name), std::move(t));
  }
  return out;
}

void check_finite(const Tensor& t, const std::string& name, const std::string& file) {
  if (t.dtype() != DType::F32) return;
  const float* p = reinterpret_cast<const float*>(t.bytes());
  const int64_t n = t.numel();
  int64_t bad = n;
#pragma omp parallel for reduction(min : bad) if (n > (int64_t(1) << 20))
  for (int64_t i = 0; i < n; ++i)
    if (!(p[i] - p[i] == 0.0f)) bad = std::min(bad, i);  // NaN and +-Inf give NaN
  SIGMA_CHECK(bad == n, "{}: tensor '{}' holds a non-finite value ({} at element {} of {}); the "
              "run that wrote it diverged or the file is damaged: resume from an earlier checkpoint",
              file, name, p[bad], bad, n);
}

}  // namespace sigma
