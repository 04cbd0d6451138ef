// safetensors: round trips, the on-disk layout, every malformed-file case, a mutation fuzz, and
// interop with an independent json + numpy implementation (tests/safetensors_interop.py).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>

#include "io/safetensors.h"

#include "cli_util.h"

using namespace sigma;
namespace fs = std::filesystem;

namespace {

using sigma::testing::TempDir;

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string le64(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[i] = static_cast<char>(v >> (8 * i));
  return s;
}

// A file with a hand-written header: the length prefix is the header's unless given.
std::string raw_file(const std::string& header, const std::string& data,
                     std::optional<uint64_t> len = std::nullopt) {
  return le64(len.value_or(header.size())) + header + data;
}

// Reading `path` must throw sigma::Error whose message holds the path and every part.
void expect_read_error(const std::string& path, const std::vector<std::string>& parts) {
  try {
    read_safetensors(path);
    ADD_FAILURE() << "no error reading " << path;
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << "message lacks the path: " << msg;
    for (const auto& p : parts)
      EXPECT_NE(msg.find(p), std::string::npos) << "message lacks '" << p << "': " << msg;
  }
}

Tensor filled(DType dt, Shape shape, uint8_t seed) {
  Tensor t(dt, std::move(shape));
  for (size_t i = 0; i < t.nbytes(); ++i) t.bytes()[i] = std::byte(uint8_t(seed + 37 * i));
  return t;
}

bool same(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.bytes(), b.bytes(), a.nbytes()) == 0;
}

}  // namespace

TEST(Safetensors, RoundTripsEveryDtypeScalarsAndEmptyTensors) {
  TempDir dir;
  TensorMap in;
  in.emplace("f32", filled(DType::F32, {3, 5}, 1));
  in.emplace("bf16", filled(DType::BF16, {7}, 2));
  in.emplace("i32", filled(DType::I32, {2, 3, 4}, 3));
  in.emplace("i64", filled(DType::I64, {5}, 4));
  in.emplace("u16", filled(DType::U16, {1, 9}, 5));
  in.emplace("u8", filled(DType::U8, {13}, 6));  // 13 bytes: later tensors start unaligned
  in.emplace("scalar", filled(DType::F32, {}, 7));
  in.emplace("empty", Tensor(DType::F32, {0, 3}));
  in.emplace("empty_i64", Tensor(DType::I64, {4, 0}));
  in.emplace("big", filled(DType::F32, {1 << 20}, 8));
  Tensor special = Tensor::f32({5});  // bit patterns that a float compare would hide
  const float sp[5] = {-0.0f, std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(), 1e-45f, -3.5f};
  std::memcpy(special.f(), sp, sizeof sp);
  in.emplace("special", std::move(special));
  const Metadata meta = {{"config", R"({"d": 64})"}, {"unicode", "héllo ✓"}, {"empty", ""}};

  write_safetensors(dir / "m.safetensors", tensor_refs(in), meta);
  Safetensors out = read_safetensors(dir / "m.safetensors");
  EXPECT_EQ(out.metadata, meta);
  ASSERT_EQ(out.tensors.size(), in.size());
  for (const auto& [name, t] : in) {
    ASSERT_TRUE(out.tensors.count(name)) << name;
    EXPECT_TRUE(same(t, out.tensors.at(name))) << name;
  }
  EXPECT_EQ(out.tensors.at("scalar").numel(), 1);
  EXPECT_TRUE(out.tensors.at("scalar").shape().empty());
}

TEST(Safetensors, NoTensorsAndNoMetadataIsAValidFile) {
  TempDir dir;
  write_safetensors(dir / "e.safetensors", {}, {});
  Safetensors out = read_safetensors(dir / "e.safetensors");
  EXPECT_TRUE(out.tensors.empty());
  EXPECT_TRUE(out.metadata.empty());
}

TEST(Safetensors, LayoutIsPaddedHeaderThenSortedContiguousData) {
  TempDir dir;
  Tensor b = filled(DType::U8, {3}, 1), a = filled(DType::I64, {2}, 2), c = filled(DType::F32, {1}, 3);
  write_safetensors(dir / "l.safetensors", {tensor_ref("b", b), tensor_ref("c", c), tensor_ref("a", a)},
                    {{"k", "v"}});
  const std::string bytes = read_bytes(dir / "l.safetensors");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  EXPECT_EQ(n % 8, 0u);
  EXPECT_EQ(bytes[8], '{');
  ASSERT_EQ(bytes.size(), 8 + n + 16 + 3 + 4);
  auto h = nlohmann::json::parse(bytes.substr(8, n));
  EXPECT_EQ(h["__metadata__"]["k"], "v");
  EXPECT_EQ(h["a"]["data_offsets"], nlohmann::json({0, 16}));  // sorted by name
  EXPECT_EQ(h["b"]["data_offsets"], nlohmann::json({16, 19}));
  EXPECT_EQ(h["c"]["data_offsets"], nlohmann::json({19, 23}));
  EXPECT_EQ(h["a"]["dtype"], "I64");
  EXPECT_EQ(h["c"]["shape"], nlohmann::json({1}));
  EXPECT_EQ(bytes.substr(8 + n + 16, 3), std::string(reinterpret_cast<const char*>(b.bytes()), 3));
}

TEST(Safetensors, WriterRejectsBadInputAndLeavesNoFile) {
  TempDir dir;
  Tensor t = Tensor::f32({2});
  const std::string p = dir / "bad.safetensors";
  EXPECT_THROW(write_safetensors(p, {tensor_ref("x", t), tensor_ref("x", t)}, {}), Error);
  EXPECT_THROW(write_safetensors(p, {tensor_ref("__metadata__", t)}, {}), Error);
  EXPECT_THROW(write_safetensors(p, {tensor_ref("", t)}, {}), Error);
  EXPECT_THROW(write_safetensors(p, {{"x", DType::F32, {2}, nullptr}}, {}), Error);
  EXPECT_THROW(write_safetensors(p, {{"x", DType::F32, {-1}, t.bytes()}}, {}), Error);
  EXPECT_THROW(write_safetensors(p, {tensor_ref("bad\xff", t)}, {}), Error);  // not UTF-8
  EXPECT_FALSE(fs::exists(p));
  EXPECT_THROW(write_safetensors(dir / "no/such/dir/x.safetensors", {}, {}), Error);
}

TEST(Safetensors, MalformedHeadersAreErrorsNamingTheTensorOrKey) {
  TempDir dir;
  const std::string d8(8, '\1'), d12(12, '\2');
  auto entry = [](const std::string& name, const std::string& shape, const std::string& off,
                  const std::string& dtype = "F32") {
    return fmt::format(R"("{}": {{"dtype": "{}", "shape": {}, "data_offsets": {}}})", name, dtype,
                       shape, off);
  };
  struct Case {
    const char* label;
    std::string header, data;
    std::vector<std::string> parts;
  };
  const std::vector<Case> cases = {
      {"invalid json", R"({"w": {"dtype": "F32")", d8, {"not valid JSON"}},
      {"empty header", "", "", {"not valid JSON"}},
      {"not utf-8", "{\"w\xff\": 1}", "", {"not valid JSON"}},
      {"top level array", "[1, 2]", "", {"must be a JSON object"}},
      {"entry not object", R"({"w": 5})", "", {"'w'"}},
      {"unknown dtype", "{" + entry("w", "[2]", "[0, 4]", "F16") + "}", d8.substr(4),
       {"'w'", "F16"}},
      {"non-string dtype", R"({"w": {"dtype": 1, "shape": [], "data_offsets": [0, 4]}})", "",
       {"'w'", "dtype"}},
      {"missing offsets", R"({"w": {"dtype": "F32", "shape": [2]}})", d8,
       {"'w'", "data_offsets"}},
      {"three offsets", "{" + entry("w", "[2]", "[0, 8, 8]") + "}", d8, {"'w'", "data_offsets"}},
      {"unknown field", R"({"w": {"dtype": "F32", "shape": [], "data_offsets": [0, 4], "extra": 1}})",
       d8.substr(4), {"'w'", "'extra'"}},
      {"negative dim", "{" + entry("w", "[-2]", "[0, 8]") + "}", d8, {"'w'", "shape"}},
      {"float dim", "{" + entry("w", "[2.0]", "[0, 8]") + "}", d8, {"'w'", "shape"}},
      {"string dim", "{" + entry("w", R"(["2"])", "[0, 8]") + "}", d8, {"'w'", "shape"}},
      {"dim beyond int64", "{" + entry("w", "[18446744073709551615]", "[0, 8]") + "}", d8,
       {"'w'", "too large"}},
      {"shape overflows", "{" + entry("w", "[4294967296, 4294967296, 4294967296]", "[0, 8]") + "}",
       d8, {"'w'", "too large"}},
      {"negative offset", "{" + entry("w", "[2]", "[-8, 0]") + "}", d8, {"'w'", "data_offsets"}},
      {"offsets reversed", "{" + entry("w", "[0]", "[8, 0]") + "}", d8, {"'w'", "end before"}},
      {"offsets past buffer", "{" + entry("w", "[2]", "[0, 8]") + "}", d8.substr(4),
       {"'w'", "run past"}},
      {"huge offsets", "{" + entry("w", "[2]", "[18446744073709551608, 18446744073709551615]") + "}",
       d8, {"'w'"}},
      {"size mismatch", "{" + entry("w", "[3]", "[0, 8]") + "}", d8, {"'w'", "needs 12"}},
      {"overlap", "{" + entry("a", "[2]", "[0, 8]") + ", " + entry("b", "[2]", "[4, 12]") + "}",
       d12, {"'b'", "overlap", "'a'"}},
      {"gap", "{" + entry("w", "[2]", "[4, 12]") + "}", d12, {"'w'", "unused bytes"}},
      {"trailing bytes", "{" + entry("w", "[2]", "[0, 8]") + "}", d12, {"after the last tensor"}},
      {"duplicate name", "{" + entry("w", "[2]", "[0, 8]") + ", " + entry("w", "[2]", "[0, 8]") + "}",
       d8, {"duplicate tensor name 'w'"}},
      {"duplicate field",
       R"({"w": {"dtype": "F32", "dtype": "I32", "shape": [2], "data_offsets": [0, 8]}})", d8,
       {"duplicate key 'dtype' in 'w'"}},
      {"duplicate metadata key", R"({"__metadata__": {"k": "a", "k": "b"}})", "",
       {"duplicate key 'k' in '__metadata__'"}},
      {"non-string metadata", R"({"__metadata__": {"ok": "x", "step": 5}})", "", {"'step'"}},
      {"metadata not object", R"({"__metadata__": "x"})", "", {"__metadata__"}},
      {"deep nesting", R"({"w": {"shape": [[[[1]]]]}})", "", {"nests deeper"}},
      {"very deep nesting", std::string(100000, '[') + std::string(100000, ']'), "",
       {"nests deeper"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.label);
    const std::string p = dir / "case.safetensors";
    write_bytes(p, raw_file(c.header, c.data));
    expect_read_error(p, c.parts);
  }
}

TEST(Safetensors, BadLengthsAndTruncationAreErrors) {
  TempDir dir;
  const std::string p = dir / "t.safetensors";
  write_bytes(p, "");
  expect_read_error(p, {"truncated"});
  write_bytes(p, std::string(5, '\0'));
  expect_read_error(p, {"truncated"});
  write_bytes(p, raw_file("{}", "", 4096));
  expect_read_error(p, {"header length 4096", "runs past the end"});
  write_bytes(p, raw_file("{}", "", (200ull << 20)));
  expect_read_error(p, {"exceeds"});
  write_bytes(p, raw_file("{}", "", ~0ull));
  expect_read_error(p, {"exceeds"});

  Tensor a = filled(DType::F32, {4}, 1), b = filled(DType::I32, {3}, 2);
  write_safetensors(p, {tensor_ref("a", a), tensor_ref("b", b)}, {{"k", "v"}});
  const std::string whole = read_bytes(p);
  write_bytes(p, whole.substr(0, whole.size() - 3));  // cut into the last tensor, 'b'
  expect_read_error(p, {"'b'", "truncated"});
  write_bytes(p, whole.substr(0, 20));  // cut into the header
  expect_read_error(p, {"runs past the end"});

  expect_read_error(dir / "missing.safetensors", {"cannot open"});
  expect_read_error(dir.path.string(), {"not a regular file"});
}

// Random bit flips, byte stores and truncations of a valid file: the reader either returns
// tensors whose sizes agree with their shapes or throws sigma::Error; nothing else.
TEST(Safetensors, RandomCorruptionOnlyEverThrowsSigmaError) {
  TempDir dir;
  Tensor a = filled(DType::F32, {2, 3}, 1), b = filled(DType::BF16, {5}, 2),
         c = filled(DType::I64, {}, 3), e(DType::U8, {0});
  const std::string p = dir / "f.safetensors";
  write_safetensors(p, {tensor_ref("a", a), tensor_ref("b", b), tensor_ref("c", c), tensor_ref("e", e)},
                    {{"step", "10"}, {"cfg", "{}"}});
  const std::string good = read_bytes(p);
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(uint8_t(good[i])) << (8 * i);
  const size_t header_end = 8 + n;
  ASSERT_LT(header_end, good.size());
  const std::string interesting("{}[]\":, 0123456789-.eE\\\xff\0", 25);

  std::mt19937_64 rng(20240607);
  auto pick = [&](size_t n) { return size_t(rng() % n); };
  int errors = 0, reads = 0;
  for (int it = 0; it < 2000; ++it) {
    std::string f = good;
    switch (it % 5) {
      case 0:  // flip bits in the length prefix or header
        for (int k = 1 + pick(3); k > 0; --k) f[pick(header_end)] ^= char(1 << pick(8));
        break;
      case 1:  // store random bytes anywhere
        for (int k = 1 + pick(3); k > 0; --k) f[pick(f.size())] = char(rng());
        break;
      case 2:  // truncate
        f.resize(pick(f.size()));
        break;
      case 3:  // store JSON punctuation and digits into the header
        for (int k = 1 + pick(2); k > 0; --k)
          f[8 + pick(header_end - 8)] = interesting[pick(interesting.size())];
        break;
      case 4:  // delete or duplicate a header byte, keeping the length prefix
        if (rng() & 1) f.erase(8 + pick(header_end - 8), 1);
        else f.insert(8 + pick(header_end - 8), 1, f[8 + pick(header_end - 8)]);
        break;
    }
    write_bytes(p, f);
    try {
      Safetensors s = read_safetensors(p);
      ++reads;
      for (const auto& [name, t] : s.tensors)
        ASSERT_EQ(t.nbytes(), size_t(shape_numel(t.shape())) * dtype_size(t.dtype())) << name;
    } catch (const Error&) {
      ++errors;
    }
  }
  EXPECT_GT(errors, 1000);  // most mutations must be caught...
  EXPECT_GT(reads, 0);      // ...while data-only changes still read
}

TEST(SafetensorsInterop, NumpyReadsOursAndWeReadNumpys) {
  if (::access("/usr/bin/python3", X_OK) != 0) GTEST_SKIP() << "/usr/bin/python3 not found";
  if (std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "numpy missing (apt install python3-numpy)";
  TempDir dir;
  const std::string script = std::string(SIGMA_SOURCE_DIR) + "/tests/safetensors_interop.py";

  // Must match expected_from_sigma() in the script.
  Tensor f32 = Tensor::f32({2, 3});
  for (int i = 0; i < 6; ++i) f32.f()[i] = i * 0.5f - 1.0f;
  Tensor i32(DType::I32, {4});
  const int32_t iv[4] = {-2, 0, 7, 2147483647};
  std::memcpy(i32.bytes(), iv, sizeof iv);
  Tensor bf16(DType::BF16, {3});
  const uint16_t bv[3] = {0x3F80, 0xC020, 0x3E20};  // 1.0, -2.5, 0.15625
  std::memcpy(bf16.bytes(), bv, sizeof bv);
  Tensor i64(DType::I64, {2});
  const int64_t lv[2] = {-(int64_t(1) << 40), 3};
  std::memcpy(i64.bytes(), lv, sizeof lv);
  Tensor u16(DType::U16, {3});
  const uint16_t uv[3] = {0, 1, 65535};
  std::memcpy(u16.bytes(), uv, sizeof uv);
  Tensor u8(DType::U8, {2, 2});
  const uint8_t cv[4] = {0, 1, 254, 255};
  std::memcpy(u8.bytes(), cv, sizeof cv);
  Tensor scalar = Tensor::f32({});
  scalar.f()[0] = 3.25f;
  Tensor empty = Tensor::f32({0, 4});
  const std::string ours = dir / "ours.safetensors";
  write_safetensors(ours,
                    {tensor_ref("a.f32", f32), tensor_ref("b.i32", i32), tensor_ref("c.bf16", bf16),
                     tensor_ref("d.i64", i64), tensor_ref("e.u16", u16), tensor_ref("f.u8", u8),
                     tensor_ref("g.scalar", scalar), tensor_ref("h.empty", empty)},
                    {{"format", "sigma"}, {"note", "héllo ✓"}});
  EXPECT_EQ(std::system(fmt::format("/usr/bin/python3 '{}' check '{}'", script, ours).c_str()), 0);

  const std::string theirs = dir / "theirs.safetensors";
  ASSERT_EQ(std::system(fmt::format("/usr/bin/python3 '{}' write '{}'", script, theirs).c_str()), 0);
  Safetensors s = read_safetensors(theirs);
  EXPECT_EQ(s.metadata, (Metadata{{"source", "numpy"}, {"step", "12"}}));
  ASSERT_EQ(s.tensors.size(), 5u);
  const Tensor& x = s.tensors.at("x.f32");
  ASSERT_EQ(x.dtype(), DType::F32);
  ASSERT_EQ(x.shape(), (Shape{3, 2}));
  for (int i = 0; i < 6; ++i) EXPECT_EQ(x.f()[i], i * 0.25f - 0.5f);
  const Tensor& y = s.tensors.at("y.i32");
  ASSERT_EQ(y.dtype(), DType::I32);
  ASSERT_EQ(y.shape(), (Shape{5}));
  const int32_t want_y[5] = {1, -1, 100000, std::numeric_limits<int32_t>::min(), 42};
  for (int i = 0; i < 5; ++i) EXPECT_EQ(y.data<int32_t>()[i], want_y[i]);
  const Tensor& z = s.tensors.at("a.bf16");
  ASSERT_EQ(z.dtype(), DType::BF16);
  ASSERT_EQ(z.shape(), (Shape{4}));
  const float want_z[4] = {1.0f, -2.0f, 0.5f, 3.140625f};
  for (int i = 0; i < 4; ++i) {
    uint32_t bits = uint32_t(z.data<uint16_t>()[i]) << 16;
    float v;
    std::memcpy(&v, &bits, 4);
    EXPECT_EQ(v, want_z[i]) << i;
  }
  const Tensor& w = s.tensors.at("w.scalar");
  ASSERT_EQ(w.shape(), Shape{});
  EXPECT_EQ(w.f()[0], 7.5f);
  EXPECT_EQ(s.tensors.at("v.empty").shape(), (Shape{0}));
  EXPECT_EQ(s.tensors.at("v.empty").dtype(), DType::I32);
}
