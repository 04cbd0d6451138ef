#include "train/agreement.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/refusal.h"
#include "dist/rank_list.h"
#include "train/preflight.h"

namespace sigma {

namespace {

namespace fs = std::filesystem;

std::string hex(uint64_t h) { return fmt::format("{:016x}", h); }

// This executable's bytes: ranks started from different builds differ here first.
std::string binary_hash() {
  std::ifstream in("/proc/self/exe", std::ios::binary);
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  std::vector<char> buf(size_t(1) << 20);
  while (in) {
    in.read(buf.data(), std::streamsize(buf.size()));
    XXH3_64bits_update(st, buf.data(), size_t(in.gcount()));
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return hex(h);
}

// Each file under `dir` (sorted by path): its path, size and a hash of its first 64 KiB (the
// shards' headers, which carry the tokenizer hash). Reading all of it would cost a pass over
// the corpus at every start.
std::string directory_digest(const std::string& dir) {
  std::vector<std::pair<std::string, uint64_t>> files;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::end(it); it.increment(ec))
    if (it->is_regular_file(ec)) files.push_back({fs::relative(it->path(), dir, ec).string(), 0});
  std::sort(files.begin(), files.end());
  XXH3_state_t* st = XXH3_createState();
  XXH3_64bits_reset(st);
  std::vector<char> head(size_t(1) << 16);
  for (auto& [name, size] : files) {
    const std::string path = dir + "/" + name;
    size = fs::file_size(path, ec);
    std::ifstream in(path, std::ios::binary);
    in.read(head.data(), std::streamsize(head.size()));
    XXH3_64bits_update(st, name.data(), name.size() + 1);
    XXH3_64bits_update(st, &size, sizeof size);
    XXH3_64bits_update(st, head.data(), size_t(in.gcount()));
  }
  const uint64_t h = XXH3_64bits_digest(st);
  XXH3_freeState(st);
  return fmt::format("{} files, {}", files.size(), hex(h));
}

void flatten(const nlohmann::json& j, const std::string& prefix,
             std::vector<std::pair<std::string, std::string>>& out) {
  if (j.is_object() && !j.empty() && prefix.find("sampler") == std::string::npos) {
    for (const auto& [k, v] : j.items()) flatten(v, prefix.empty() ? k : prefix + "." + k, out);
    return;
  }
  out.push_back({prefix, j.dump()});
}

uint64_t entry_hash(const std::pair<std::string, std::string>& e) {
  const std::string s = e.first + '\0' + e.second;
  return XXH3_64bits(s.data(), s.size());
}

constexpr size_t kValueBytes = 120;  // a value shown in the message, cut to this length

}  // namespace

std::vector<std::pair<std::string, std::string>> start_up_record(Config& cfg, const DataSource& data) {
  std::vector<std::pair<std::string, std::string>> out;
  out.push_back({"sigma binary", binary_hash()});
  std::string manifest = fmt::format("domains {}, vocab {}, tokenizer {}", fmt::join(data.domains(), ","),
                                     data.vocab(), hex(data.tokenizer_hash()));
  if (cfg.data.source == "shards") manifest += ", shards " + directory_digest(cfg.data.path);
  if (!cfg.data.eval_path.empty()) manifest += ", held-out " + directory_digest(cfg.data.eval_path);
  out.push_back({"data manifest", manifest});
  flatten(cfg.to_json(), "", out);
  return out;
}

std::string disagreement(const std::string& key, const std::vector<std::string>& values) {
  std::vector<std::string> distinct;  // in order of the lowest rank holding each
  std::map<std::string, std::vector<int>> holders;
  for (size_t r = 0; r < values.size(); ++r) {
    if (!holders.count(values[r])) distinct.push_back(values[r]);
    holders[values[r]].push_back(int(r));
  }
  if (distinct.size() < 2) return "";
  std::vector<std::string> parts;
  for (const auto& v : distinct) {
    const auto& rs = holders[v];
    parts.push_back(fmt::format("{} on rank{} {}", v, rs.size() > 1 ? "s" : "", rank_list(rs)));
  }
  return fmt::format("the ranks were started differently: {} is {}; start every rank with the "
                     "same config, data and sigma binary", key, fmt::join(parts, ", "));
}

void check_ranks_agree(Communicator& comm, const std::vector<std::pair<std::string, std::string>>& record) {
  const int R = comm.size();
  if (R == 1) return;
  std::vector<uint64_t> hashes;
  for (const auto& e : record) hashes.push_back(entry_hash(e));
  uint64_t mine[2] = {XXH3_64bits(hashes.data(), hashes.size() * sizeof(uint64_t)), hashes.size()};
  std::vector<uint64_t> all(2 * size_t(R));
  comm.all_gather_bytes(all.data(), mine, sizeof mine);
  bool same = true;
  uint64_t longest = 0;
  for (int r = 0; r < R; ++r) {
    same = same && all[2 * size_t(r)] == mine[0];
    longest = std::max(longest, all[2 * size_t(r) + 1]);
  }
  if (same) return;
  // The first entry whose hash differs between any two ranks (padding: a missing entry).
  hashes.resize(size_t(longest), 0);
  std::vector<uint64_t> every(size_t(longest) * size_t(R));
  comm.all_gather_bytes(every.data(), hashes.data(), hashes.size() * sizeof(uint64_t));
  size_t first = 0;
  for (; first < longest; ++first) {
    bool differs = false;
    for (int r = 1; r < R; ++r) differs = differs || every[size_t(r) * longest + first] != every[first];
    if (differs) break;
  }
  // Every rank's key and value there, cut to a fixed record.
  char text[2 * kValueBytes] = {};
  if (first < record.size()) {
    std::strncpy(text, record[first].first.c_str(), kValueBytes - 1);
    std::string v = record[first].second;
    if (v.size() > kValueBytes - 1) v = v.substr(0, kValueBytes - 4) + "...";
    std::strncpy(text + kValueBytes, v.c_str(), kValueBytes - 1);
  } else {
    std::strncpy(text + kValueBytes, "(absent)", kValueBytes - 1);
  }
  std::vector<char> texts(sizeof text * size_t(R));
  comm.all_gather_bytes(texts.data(), text, sizeof text);
  std::string key;
  std::vector<std::string> values;
  for (int r = 0; r < R; ++r) {
    const char* t = texts.data() + sizeof text * size_t(r);
    if (key.empty()) key = t;
    values.emplace_back(t + kValueBytes);
  }
  std::string line = disagreement(key, values);
  if (line.empty())  // the same value under different keys: binaries with different options
    line = fmt::format("the ranks were started differently: their config keys differ at '{}'; "
                       "start every rank with the same config, data and sigma binary", key);
  if (comm.rank() == 0) fail("{}", line);
  comm.barrier();  // rank 0 never enters: its error path aborts every rank (apps/sigma.cpp)
  fail("{}", line);
}

void check_ranks_see_dir(Communicator& world, const std::string& dir) {
  const int R = world.size();
  if (R == 1 || dir.empty()) return;
  const std::string path = dir + "/.sigma-shared-check";
  uint64_t token = 0;
  if (world.rank() == 0) {
    token = std::random_device{}() * 0x9E3779B97F4A7C15ull ^ uint64_t(::getpid());
    std::ofstream(path) << token;
  }
  world.broadcast(&token, sizeof token, 0);
  uint64_t seen = 0;
  std::ifstream(path) >> seen;
  const uint8_t ok = seen == token ? 1 : 0;
  std::vector<uint8_t> all(static_cast<size_t>(R));
  world.all_gather_bytes(all.data(), &ok, 1);
  if (world.rank() == 0) {
    std::error_code ec;
    fs::remove(path, ec);
  }
  // The hosts, for the refusal only: every rank has `all`, so all of them gather or none (the
  // run's start gathered them once already, for the grid; not again on every start).
  if (std::all_of(all.begin(), all.end(), [](uint8_t x) { return x == 1; })) return;
  const std::vector<std::string> hosts = hosts_of_ranks(world);
  std::vector<int> blind;
  std::vector<std::string> where;
  for (int r = 0; r < R; ++r)
    if (!all[size_t(r)]) {
      blind.push_back(r);
      const std::string& h = hosts[size_t(r)];
      if (std::find(where.begin(), where.end(), h) == where.end()) where.push_back(h);
    }
  if (blind.empty()) return;
  throw Refusal(fmt::format(
      "rank{} {} (on {}) cannot see the run folder {} that rank 0 created: every rank writes "
      "its checkpoint files into it, so --out must be on a filesystem every host shares (NFS, "
      "Lustre, ...) at the same path", blind.size() > 1 ? "s" : "", rank_list(blind),
      fmt::join(where, ", "), dir));
}

}  // namespace sigma
