// Tensor names (DESIGN §4) are the checkpoint format: the strings are pinned here, and every name
// a model registers parses back to the block, group and leaf it was built from.
#include <gtest/gtest.h>

#include "model/names.h"
#include "model/params.h"
#include "model/weights.h"

using namespace sigma;

namespace {

// Two RRE blocks of three; groups named like the name's own parts, to test parsing by position.
ModelConfig config(const std::string& router) {
  ModelConfig c;
  c.vocab = 11;
  c.d_model = 8;
  c.heads = 2;
  c.context = 4;
  c.layers = 3;
  c.rre_layers = 2;
  c.router = router;
  c.groups = {{"rre", 2}, {"gate", 3}, {"w_in", 1}};
  c.domains = {{"a", "rre", 0}, {"b", "gate", 0}, {"c", "w_in", 0}};
  return c;
}

}  // namespace

TEST(Names, BuildTheOnDiskStrings) {
  EXPECT_STREQ(names::kTokens, "embed.tokens");
  EXPECT_STREQ(names::kPositions, "embed.positions");
  EXPECT_STREQ(names::kFinalLnW, "final_ln.w");
  EXPECT_STREQ(names::kFinalLnB, "final_ln.b");
  EXPECT_EQ(names::block(3, "attn.qkv.w"), "blocks.3.attn.qkv.w");
  EXPECT_EQ(names::ffn(0, names::kWOut), "blocks.0.ffn.w_out");
  EXPECT_EQ(names::expert_prefix(7, "python"), "blocks.7.rre.python");
  EXPECT_EQ(names::expert(7, "python", names::kWIn), "blocks.7.rre.python.w_in");
  EXPECT_EQ(names::gate_prefix(2, "code"), "blocks.2.gate.code");
  EXPECT_EQ(names::gate(2, "code"), "blocks.2.gate.code.w");
  EXPECT_EQ(names::routing(7, "python"), "routing.7.python");
  EXPECT_EQ(names::expert_slice("blocks.1.rre.g.w_in", 4), "blocks.1.rre.g.w_in[4]");
  const std::vector<std::string> leaves(std::begin(names::kExpertLeaves),
                                        std::end(names::kExpertLeaves));
  EXPECT_EQ(leaves, (std::vector<std::string>{"w_in", "b_in", "w_out", "b_out"}));
}

TEST(Names, EveryRegisteredNameParsesBack) {
  for (const char* router : {"rre", "top1"}) {
    const ModelConfig c = config(router);
    ParamSet ps;
    register_params(ps, c);
    BufferSet bs;
    register_buffers(bs, c);
    int experts = 0, gates = 0;
    for (const Param& p : ps.all()) {
      const int l = names::block_of(p.name);
      const std::string g = names::group_of(p.name);
      EXPECT_EQ(names::is_expert(p.name), p.expert) << p.name;
      if (p.expert) {
        EXPECT_EQ(names::expert(l, g, names::leaf_of(p.name)), p.name);
        EXPECT_EQ(names::expert_prefix_of(p.name), names::expert_prefix(l, g));
        ++experts;
      } else if (names::is_gate(p.name)) {
        EXPECT_EQ(names::gate(l, g), p.name);
        ++gates;
      } else {
        EXPECT_EQ(g, "") << p.name;
        EXPECT_EQ(l >= 0, p.name.starts_with("blocks.")) << p.name;
      }
      EXPECT_FALSE(names::is_routing(p.name)) << p.name;
    }
    EXPECT_EQ(experts, 2 * 3 * 4);  // blocks 1-2, three groups, four leaves
    EXPECT_EQ(gates, c.gated() ? 2 * 3 : 0);
    for (const Buffer& b : bs.all()) {
      EXPECT_TRUE(names::is_routing(b.name));
      EXPECT_EQ(names::routing(names::block_of(b.name), names::group_of(b.name)), b.name);
    }
    EXPECT_EQ(bs.all().size(), c.gated() ? 0u : 2u * 3u);
  }
}

TEST(Names, InitialisationRoles) {
  for (const char* n : {"final_ln.w", "blocks.0.ln1.w", "blocks.2.ln2.w"})
    EXPECT_TRUE(names::is_ln_gain(n)) << n;
  for (const char* n : {"final_ln.b", "blocks.0.ln1.b", "embed.tokens", "blocks.1.attn.qkv.w"})
    EXPECT_FALSE(names::is_ln_gain(n)) << n;
  for (const char* n : {"blocks.0.attn.out.w", "blocks.0.ffn.w_out", "blocks.2.rre.g.w_out"})
    EXPECT_TRUE(names::is_residual_projection(n)) << n;
  for (const char* n : {"blocks.0.attn.out.b", "blocks.0.ffn.w_in", "blocks.2.rre.g.b_out",
                        "blocks.2.gate.g.w"})
    EXPECT_FALSE(names::is_residual_projection(n)) << n;
}

TEST(Names, ParsingOfOtherNames) {
  EXPECT_EQ(names::block_of("embed.tokens"), -1);
  EXPECT_EQ(names::block_of("blocks.x.ln1.w"), -1);
  EXPECT_EQ(names::block_of("routing.12.g"), 12);
  EXPECT_EQ(names::group_of("embed.tokens"), "");
  EXPECT_EQ(names::group_of("blocks.1.attn.qkv.w"), "");
  // Optimizer state of an expert is still the expert's.
  EXPECT_TRUE(names::is_expert("blocks.1.rre.g.w_in.m"));
  EXPECT_EQ(names::group_of("blocks.1.rre.g.steps"), "g");
}
