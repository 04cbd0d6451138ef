// Encode/decode: every byte string round-trips exactly through a trained tokenizer.
#include <array>

#include "data/tokenizer.h"
#include "fuzz.h"

namespace {
const sigma::data::Tokenizer& tokenizer() {
  static const sigma::data::Tokenizer t = [] {
    std::array<std::string, 4> texts = {"the cat sat on the mat and the dog ran",
                                        "def f(x):\n    return x + 1\n\n\n",
                                        "\xe4\xb8\xad\xe6\x96\x87 \xe6\xb5\x8b\xe8\xaf\x95 <EOT>",
                                        "    indented    spaces        here"};
    sigma::data::TrainOptions o;
    o.vocab_size = 360;  // 279 fixed tokens (controls, bytes, space runs) + merges
    o.min_pair_count = 1;
    return sigma::data::Tokenizer::train(texts, o);
  }();
  return t;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const auto ids = tokenizer().encode(text);
  for (uint32_t id : ids)
    if (id >= tokenizer().vocab_size()) sigma::fuzz::finding("encode produced an id outside the vocabulary");
  if (tokenizer().decode(ids) != text) sigma::fuzz::finding("decode(encode(x)) != x");
  return 0;
}
