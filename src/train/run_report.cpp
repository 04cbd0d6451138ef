// What a run reports besides its losses: expert load, the ECSS offload counters, memory, and
// why it stopped (summary.json and the end-of-run lines; docs/usage.md).
#include "train/trainer.h"

#include <fmt/format.h>

#include <algorithm>
#include <csignal>
#include <cstdlib>
#include <fstream>

namespace sigma {

nlohmann::json expert_load_json(const std::vector<BlockLoad>& load, const ModelConfig& cfg) {
  nlohmann::json j = nlohmann::json::object();
  for (const BlockLoad& b : load) {
    nlohmann::json groups = nlohmann::json::object();
    for (size_t g = 0; g < b.tokens.size(); ++g) groups[cfg.groups[g].name] = b.tokens[g];
    j[std::to_string(b.block)] = groups;
  }
  return j;
}

nlohmann::json load_imbalance_json(const std::vector<BlockLoad>& load) {
  nlohmann::json j = nlohmann::json::object();
  for (const BlockLoad& b : load) j[std::to_string(b.block)] = b.imbalance();
  return j;
}

// The process's storage I/O and resident memory (Linux /proc), and the ECSS counters: what a
// run over an expert store larger than RAM is judged by (docs/ecss.md, "Memory budget").
nlohmann::json offload_json(const OffloadStats& o, int64_t steps) {
  auto field = [](const char* file, const std::string& key) -> double {
    std::ifstream in(file);
    for (std::string line; std::getline(in, line);)
      if (line.starts_with(key)) return std::strtod(line.c_str() + key.size(), nullptr);
    return 0;
  };
  const double GiB = double(1 << 30), MiB = double(1 << 20);
  const double per = double(std::max<int64_t>(steps, 1));
  return {{"pieces_per_step", double(o.pieces) / per},
          {"gathered_gib_per_step", double(o.gathered_bytes) / GiB / per},
          {"reused_gib_per_step", double(o.reused_bytes) / GiB / per},
          {"records_gib_per_step", double(o.record_bytes) / GiB / per},
          {"compute_buffer_mib", double(o.compute_bytes) / MiB},
          {"prefetches_skipped", o.prefetches_skipped},
          {"gather_s", o.gather_s}, {"prefetch_wait_s", o.wait_s}, {"update_s", o.update_s},
          {"process_read_gib", field("/proc/self/io", "read_bytes:") / GiB},
          {"process_write_gib", field("/proc/self/io", "write_bytes:") / GiB},
          {"rss_anon_mib", field("/proc/self/status", "RssAnon:") / 1024},
          {"rss_file_mib", field("/proc/self/status", "RssFile:") / 1024}};
}

double peak_rss_mib() {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);)
    if (line.starts_with("VmHWM:")) return std::strtod(line.c_str() + 6, nullptr) / 1024;
  return 0;
}

std::string stop_reason(int stopped_by) {
  switch (stopped_by) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    case SIGUSR2: return "SIGUSR2";
    case kStoppedByTimeLimit: return "the time limit (train.max_minutes)";
    default: return fmt::format("signal {}", stopped_by);
  }
}

}  // namespace sigma
