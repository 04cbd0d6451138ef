// The smallest servable model of the HTTP tests (framing, pipelining, hostile clients): one
// block of width 8, two slots, one domain, its vocabulary the tokenizer's.
#pragma once
#include "data/tokenizer.h"
#include "model/config.h"

namespace sigma::testing {

inline ModelConfig tiny_serve_config(const data::Tokenizer& tok) {
  ModelConfig c;
  c.vocab = int(tok.vocab_size());
  c.d_model = 8;
  c.heads = 2;
  c.context = 32;
  c.layers = 1;
  c.slots = 2;
  c.domains = {{"prose", "prose", 0}};
  c.validate();
  return c;
}

// The HTTP tests' two-domain model (prose and code) of width 16 over the tokenizer's vocabulary.
inline ModelConfig two_domain_serve_config(const data::Tokenizer& tok, int context, int layers) {
  ModelConfig c;
  c.vocab = int(tok.vocab_size());
  c.d_model = 16;
  c.heads = 2;
  c.context = context;
  c.layers = layers;
  c.slots = 2;
  c.domains = {{"prose", "prose", 0}, {"code", "code", 1}};
  c.validate();
  return c;
}

}  // namespace sigma::testing
