// Tokenizer files: any bytes either load as a tokenizer that round-trips text, or are refused.
#include <nlohmann/json.hpp>

#include "data/tokenizer.h"
#include "fuzz.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sigma;
  const std::string path = fuzz::as_file(data, size);
  fuzz::expect_clean([&] {
    const data::Tokenizer t = data::Tokenizer::load(path);
    const std::string text = "def f(x):\n    return x  # \xc3\xa9\xe4\xb8\xad <EOT>";
    if (t.decode(t.encode(text)) != text) fuzz::finding("a loaded tokenizer does not round-trip");
  });
  return 0;
}
