// The model's tensor names (DESIGN §4), built and parsed here and nowhere else. They are the
// checkpoint format (model.safetensors, optimizer state, expert group files) and what surgery
// and train.freeze select by, so the strings must never change:
//   embed.tokens [S*V,d]   embed.positions [T,d]   final_ln.{w,b}
//   blocks.L.{ln1,ln2}.{w,b}   blocks.L.attn.{qkv,out}.{w,b}   blocks.<last>.attn.query_table
//   blocks.L.ffn.{w_in,b_in,w_out,b_out}          dense FFN
//   blocks.L.rre.G.{w_in,b_in,w_out,b_out}        group G's experts, stacked [K_g, ...]
//   blocks.L.gate.G.w [d,K_g]                     learned-gate baseline
//   routing.L.G  int32 [V]                        routing table R[l][g]
// Group names hold no '.' (ModelConfig::validate), so a group ends at the next dot.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>

namespace sigma::names {

inline constexpr const char* kTokens = "embed.tokens";
inline constexpr const char* kPositions = "embed.positions";
inline constexpr const char* kFinalLnW = "final_ln.w";
inline constexpr const char* kFinalLnB = "final_ln.b";

// The tensors of one FFN (the dense one, or each expert of a group), in registration order,
// which is also the order of an expert's record in the expert store.
inline constexpr const char* kWIn = "w_in";
inline constexpr const char* kBIn = "b_in";
inline constexpr const char* kWOut = "w_out";
inline constexpr const char* kBOut = "b_out";
inline constexpr const char* kExpertLeaves[] = {kWIn, kBIn, kWOut, kBOut};

// ---- building ----

std::string block(int l, std::string_view leaf);                         // blocks.L.<leaf>
std::string ffn(int l, std::string_view leaf);                           // blocks.L.ffn.<leaf>
std::string expert_prefix(int l, std::string_view group);                // blocks.L.rre.G
std::string expert(int l, std::string_view group, std::string_view leaf);  // blocks.L.rre.G.<leaf>
std::string gate(int l, std::string_view group);                         // blocks.L.gate.G.w
std::string gate_prefix(int l, std::string_view group);                  // blocks.L.gate.G
std::string routing(int l, std::string_view group);                      // routing.L.G
// Expert e's slice of a stacked expert tensor, "<tensor>[e]": the key of its own RNG stream, so
// resizing a group never shifts another expert's initial values.
std::string expert_slice(std::string_view tensor, int64_t e);

// ---- parsing ----

bool is_expert(std::string_view name);   // blocks.L.rre.G.*, any suffix (optimizer state too)
bool is_gate(std::string_view name);     // blocks.L.gate.G.*
bool is_routing(std::string_view name);  // routing.L.G
// The expert group of an expert, gate or routing tensor; "" for a shared tensor.
std::string group_of(std::string_view name);
// L of blocks.L.* and routing.L.*; -1 for other names.
int block_of(std::string_view name);
// The last component: w_in, b_in, w_out, b_out, w, ...
std::string leaf_of(std::string_view name);
// blocks.L.rre.G of an expert tensor: the (block, group) whose experts it stacks.
std::string expert_prefix_of(std::string_view name);

// Roles the initialisation reads from a name: LayerNorm gains start at 1; projections that add
// into the residual stream (attn.out.w, an FFN's or expert's w_out) get init_std / sqrt(2L).
bool is_ln_gain(std::string_view name);
bool is_residual_projection(std::string_view name);

}  // namespace sigma::names
