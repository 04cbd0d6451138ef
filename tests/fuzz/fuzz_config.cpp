// Config parsers: the run config (a JSON file or --set lines), the prepare config, the
// sampler's stages and the domain registry. Each accepts or refuses with sigma::Error; an
// accepted run config round-trips through to_json.
#include <nlohmann/json.hpp>
#include <sstream>

#include "data/prepare.h"
#include "data/sampler.h"
#include "fuzz.h"
#include "model/domains.h"
#include "run/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sigma;
  const std::string text(reinterpret_cast<const char*>(data), size);
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, false);
  if (j.is_discarded()) {  // not JSON: the lines as the --set key=value of one command
    std::vector<std::string> sets;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) sets.push_back(line);
    fuzz::expect_clean([&] { Config().load("", sets); });  // one option table, not one per line
    return 0;
  }
  fuzz::expect_clean([&] {
    Config c;
    c.apply(j, "fuzz.json");
    Config again;
    again.apply(c.to_json(), "round trip");
    if (again.to_json() != c.to_json()) fuzz::finding("config does not round-trip through to_json");
  });
  fuzz::expect_clean([&] { data::PrepareConfig::from_json(j, "/nonexistent", "fuzz.json"); });
  fuzz::expect_clean([&] { data::SamplerConfig::from_json(j, "fuzz.json"); });
  fuzz::expect_clean([&] { DomainRegistry::from_json(j, "fuzz.json", DomainForm::Data); });
  fuzz::expect_clean([&] { DomainRegistry::from_json(j, "fuzz.json", DomainForm::Model); });
  return 0;
}
