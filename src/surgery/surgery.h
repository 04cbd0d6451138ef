// Model surgery (DESIGN §4): inherit a sparse model from a dense one, extract a set of domains
// as a standalone model, add and remove domains. Everything here works on a checkpoint's named
// tensors and its config, never on model internals; the model's registry (register_params /
// register_buffers) only says which names and shapes a config needs, and every result is
// checked against it before it is written.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "run/config.h"
#include "io/safetensors.h"

namespace sigma::surgery {

// A checkpoint's model as named tensors: every parameter and routing table of model.safetensors,
// the whole config, and the tokenizer file it carries ("" = none, e.g. the synthetic data).
struct NamedModel {
  Config cfg;
  TensorMap tensors;
  std::string tokenizer;  // path of the tokenizer file to carry into the output
  std::string dir;        // where it was read from ("" when built in memory)
  int64_t step = 0, tokens = 0;  // its training so far (as read)
  nlohmann::json origin;         // as read; for an output, what write_model records
};

// The origin to record for a surgery output: the command, the source checkpoint (absolute),
// its step and tokens, `extra` (e.g. the extracted domains) and the source's own origin.
nlohmann::json origin_of(const std::string& command, const NamedModel& source,
                         nlohmann::json extra = nlohmann::json::object());

// Reads a checkpoint (a directory, or a root with `latest`), checksums verified.
NamedModel read_model(const std::string& path);

// Writes `m` as a fresh checkpoint root: OUT/step-00000000 (model.safetensors, trainer.json at
// step 0 with m.origin, the tokenizer; no optimizer state: train --resume starts a fresh one)
// and OUT/latest, so train --resume, generate, eval and inspect accept it. Every tensor the config needs must be present with its shape and
// nothing else. OUT must not exist or be empty; on any failure nothing is left behind.
// Returns the checkpoint directory.
std::string write_model(const std::string& out, NamedModel& m);

// ---- inherit ----

struct InheritOptions {
  std::string tokenizer;  // grown tokenizer file ("" = the dense model's vocabulary)
};
struct InheritReport {
  int64_t vocab = 0;          // V of the sparse model
  int64_t kept_rows = 0;      // ids whose dense row was kept (same string, or the same id)
  int64_t composed_rows = 0;  // new strings: the mean of the dense rows of their pieces
  int64_t mean_rows = 0;      // no string in the dense model (a new control, an id past the
                              // tokenizer): the mean of the dense slot's rows
};

// A sparse model from a dense one: `sparse` gives the model shape (same width, depth, heads
// and context as the dense model), groups, domains and slots; vocab 0 = the dense one (or the
// grown tokenizer's); an empty domain list is taken from sparse.data as `sigma train` does.
NamedModel inherit(const NamedModel& dense, Config sparse, const InheritOptions& opt,
                   InheritReport* report = nullptr);

// ---- domains ----

// The named domains alone (in the model's order): shared tensors, their slots' embedding rows
// (slots renumbered 0.. in their old order), their groups' experts and routing tables.
NamedModel extract(const NamedModel& m, const std::vector<std::string>& domains);

// Every domain but `name` (extract of the rest); the last domain cannot be removed.
NamedModel remove_domain(const NamedModel& m, const std::string& name);

struct AddDomain {
  std::string name;       // new domain, and the name of its new expert group
  std::string init_from;  // an existing group, "dense" (needs `dense`) or "random"
  int experts = 0;        // K of the new group (0 = as many as the source group)
  std::string dense;      // dense checkpoint for init_from = "dense"
};
// A new domain on a new embedding slot (a copy of the source group's first domain's slot, or
// slot 0) with its own expert group. From a group with the same K the experts and routing
// tables are copies (the new domain starts as that group's function); with another K expert e
// copies source expert e mod K_src and the tables come from model.routing_seed. Other
// domains' tensors are untouched.
NamedModel add_domain(const NamedModel& m, const AddDomain& spec);

// ---- reports ----

struct GroupCount {
  std::string name;
  int experts = 0;
  int64_t params = 0;  // its experts over every RRE block (and gate weights)
  std::vector<std::string> domains;
};
struct DomainCount {
  std::string name, group;
  int slot = 0;
  int64_t params = 0;  // what extract of this domain alone holds
};
struct Counts {
  int64_t total = 0;      // every parameter
  int64_t shared = 0;     // parameters every domain reads, embedding excluded
  int64_t per_slot = 0;   // embedding rows of one slot, V*d
  std::vector<GroupCount> groups;
  std::vector<DomainCount> domains;
};
Counts count_params(const NamedModel& m);

}  // namespace sigma::surgery
