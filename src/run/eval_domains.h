// Which held-out domains `sigma eval` scores: a held-out folder may hold domains the model does
// not know (an extract, a model trained on part of a shared corpus), and the user may pick some.
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "model/config.h"
#include "run/data_source.h"

namespace sigma {

struct EvalDomains {
  std::vector<std::string> keep;  // scored, in the data's order
  // Data domains the model does not know: (name, why). Requested subsets leave the others out
  // without listing them here.
  std::vector<std::pair<std::string, std::string>> skipped;
};

// `data`: the held-out source's domains, named `what` in errors. `requested` empty: every data
// domain the model knows (at least one, else an error naming both lists). Otherwise exactly
// those, each of which must be a model domain present in the data (the error names the domains
// that can be evaluated).
EvalDomains choose_eval_domains(const std::vector<std::string>& data, const ModelConfig& model,
                                const std::vector<std::string>& requested, const std::string& what);

// `inner` restricted to the domains `keep` (each one of inner's): held-out rows of the other
// domains are dropped and the kept rows repacked into batches of B in the same order, so a
// folder of those domains alone gives the same batches. Evaluation only (no training stream).
std::unique_ptr<DataSource> keep_domains(std::unique_ptr<DataSource> inner,
                                         const std::vector<std::string>& keep);

}  // namespace sigma
