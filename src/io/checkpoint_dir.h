// Checkpoint directories (DESIGN.md §6): crash-safe writing, resolving and verifying.
//
// ROOT/NAME/ holds model.safetensors, optimizer.safetensors, trainer.json, optionally the
// tokenizer, and manifest.json with the size and xxh3_64 checksum (16 hex digits) of every
// other file. ROOT/latest holds the NAME of the newest complete checkpoint.
//
// Crash safety: files are written into ROOT/NAME.tmp-<pid> and fsynced, the directory is
// fsynced and renamed to ROOT/NAME, and only then does ROOT/latest move (written to
// ROOT/latest.tmp, fsynced, renamed). A crash at any point leaves every earlier checkpoint
// and `latest` as they were; at worst a NAME.tmp-<pid> directory is left behind.
#pragma once
#include <cstdint>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "io/safetensors.h"

namespace sigma {

inline constexpr const char* kModelFile = "model.safetensors";
inline constexpr const char* kOptimizerFile = "optimizer.safetensors";
inline constexpr const char* kTrainerFile = "trainer.json";
inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kLatestFile = "latest";
// A training run's folder (sigma train --out RUN) keeps its checkpoints in RUN/checkpoints.
inline constexpr const char* kRunCheckpointsDir = "checkpoints";

class CheckpointWriter {
 public:
  // Creates ROOT if needed and the temporary directory. NAME is one path component.
  CheckpointWriter(std::string root, std::string name);
  // A peer in a multi-rank save (DESIGN §9): writes its own files into the committing rank's
  // temporary directory `tmp_dir`; it never commits nor removes the directory, and the
  // committing rank records its files with add_peer_file.
  static CheckpointWriter peer(std::string tmp_dir);
  // Removes the temporary directory unless commit() completed: a failed save touches
  // nothing that was saved before.
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;
  CheckpointWriter(CheckpointWriter&&) = default;

  // Each adds one file (a plain name, not "manifest.json", not added before), fsynced.
  void add_safetensors(const std::string& file, const std::vector<TensorRef>& tensors,
                       const Metadata& meta);
  void add_json(const std::string& file, const nlohmann::json& j);
  void add_file_copy(const std::string& file, const std::string& src_path);
  // Adds `file` of the finished checkpoint `src_dir` without copying it: a hard link, with the
  // size and checksum src_dir's manifest records (checked again whenever a checkpoint is
  // opened). Returns false, adding nothing, when src_dir lacks the file or the link cannot be
  // made (another filesystem): the caller then writes it.
  bool add_link(const std::string& file, const std::string& src_dir);

  // A file a peer wrote into temp_dir(), with the size and checksum the peer took of the bytes
  // it wrote (the size is checked here).
  void add_peer_file(const std::string& file, uint64_t size, uint64_t xxh3);
  // The size and checksum recorded for `file` (added to this writer).
  std::pair<uint64_t, uint64_t> recorded(const std::string& file) const;

  // Writes the manifest, moves the directory to ROOT/NAME and points ROOT/latest at it;
  // returns ROOT/NAME. An existing ROOT/NAME is replaced only once the new one is complete.
  std::string commit();

  const std::string& temp_dir() const { return tmp_; }
  // A sharded checkpoint (io/checkpoint_shards.h): the manifest says version 2, "layout":
  // "sharded", so that a build that cannot assemble shards refuses it by its version.
  void set_sharded() { sharded_ = true; }

 private:
  std::string start_file(const std::string& file);  // validated path inside tmp_
  void record(const std::string& file);             // size + checksum for the manifest

  struct FileSum {
    uint64_t size;
    uint64_t xxh3;
  };
  CheckpointWriter() = default;
  std::string root_, name_, tmp_;
  std::map<std::string, FileSum> files_;
  bool committed_ = false;
  bool peer_ = false;
  bool sharded_ = false;
};

// `path` itself when it holds manifest.json, else the checkpoint named by `path`/latest, else
// (a first save killed before it wrote `latest`) the complete checkpoint in `path` whose name
// sorts last, else, for a run's folder (`path`/checkpoints exists), the same in that folder.
// Throws sigma::Error saying what is wrong.
std::string resolve_checkpoint(const std::string& path);

// Retention (train.keep_checkpoints, train.keep_every): of ROOT's complete checkpoints named
// step-<number>, keeps the newest `keep_last` (0 = all: nothing is deleted), those whose step
// is a multiple of `keep_every` (0 = none) and always the one `latest` names; the others are
// renamed to NAME.old-<pid> (so that a kill mid-delete leaves no half checkpoint that looks
// complete) and deleted. Call it after a commit. Returns how many were deleted.
int prune_checkpoints(const std::string& root, int64_t keep_last, int64_t keep_every);

// Checks that manifest.json is present and that every file it lists exists with the recorded
// size and checksum; throws sigma::Error naming the first file that does not.
void verify_checkpoint(const std::string& dir);

// The files manifest.json lists, with their sizes and checksums (validated, not re-hashed).
struct ManifestEntry {
  uint64_t size;
  uint64_t xxh3;
};
std::map<std::string, ManifestEntry> read_manifest(const std::string& dir);

// An ECSS checkpoint keeps each expert group (RRE block l, group G) in its own files:
// experts.l.G.safetensors (the stacked weights, named as in model.safetensors) and
// experts.l.G.adam.safetensors (their Adam state); a group no step changed since the previous
// checkpoint is hard-linked from it instead of written again. This lists them (from the
// directory; empty for other checkpoints).
std::vector<std::string> expert_group_files(const std::string& dir, bool adam);

// A multi-rank checkpoint's optimizer state: rank 0's in optimizer.safetensors, rank r's
// (ZeRO-1 shards, whole tensors) in optimizer.rank-RRRR.safetensors. The name of rank r's,
// and the other ranks' files in `dir` (from its manifest, in rank order).
std::string optimizer_shard_file(int rank);
std::vector<std::string> optimizer_shard_files(const std::string& dir);

}  // namespace sigma
