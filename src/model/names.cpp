#include "model/names.h"

#include <fmt/format.h>

#include <charconv>

namespace sigma::names {

namespace {
constexpr std::string_view kBlocks = "blocks.", kRouting = "routing.", kRre = "rre.",
                           kGate = "gate.";

// What follows "blocks.L." ("attn.qkv.w", "rre.G.w_in", ...); "" for other names. Parsing by
// position, not by searching for ".rre.", keeps a group named "rre" or "gate" unambiguous.
std::string_view in_block(std::string_view name) {
  if (!name.starts_with(kBlocks)) return {};
  const size_t dot = name.find('.', kBlocks.size());
  return dot == std::string_view::npos ? std::string_view{} : name.substr(dot + 1);
}

// G of "<kind>G.<leaf>".
std::string group_after(std::string_view rest, std::string_view kind) {
  rest.remove_prefix(kind.size());
  return std::string(rest.substr(0, rest.find('.')));
}
}  // namespace

std::string block(int l, std::string_view leaf) { return fmt::format("{}{}.{}", kBlocks, l, leaf); }

std::string ffn(int l, std::string_view leaf) { return block(l, fmt::format("ffn.{}", leaf)); }

std::string expert_prefix(int l, std::string_view group) {
  return block(l, fmt::format("{}{}", kRre, group));
}

std::string expert(int l, std::string_view group, std::string_view leaf) {
  return fmt::format("{}.{}", expert_prefix(l, group), leaf);
}

std::string gate_prefix(int l, std::string_view group) {
  return block(l, fmt::format("{}{}", kGate, group));
}

std::string gate(int l, std::string_view group) { return gate_prefix(l, group) + ".w"; }

std::string routing(int l, std::string_view group) {
  return fmt::format("{}{}.{}", kRouting, l, group);
}

std::string expert_slice(std::string_view tensor, int64_t e) {
  return fmt::format("{}[{}]", tensor, e);
}

bool is_expert(std::string_view name) { return in_block(name).starts_with(kRre); }

bool is_gate(std::string_view name) { return in_block(name).starts_with(kGate); }

bool is_routing(std::string_view name) { return name.starts_with(kRouting); }

std::string group_of(std::string_view name) {
  if (is_routing(name)) return std::string(name.substr(name.rfind('.') + 1));
  if (is_expert(name)) return group_after(in_block(name), kRre);
  if (is_gate(name)) return group_after(in_block(name), kGate);
  return "";
}

int block_of(std::string_view name) {
  std::string_view rest;
  if (name.starts_with(kBlocks)) {
    rest = name.substr(kBlocks.size());
  } else if (name.starts_with(kRouting)) {
    rest = name.substr(kRouting.size());
  } else {
    return -1;
  }
  int l = -1;
  return std::from_chars(rest.data(), rest.data() + rest.size(), l).ec == std::errc() ? l : -1;
}

std::string leaf_of(std::string_view name) { return std::string(name.substr(name.rfind('.') + 1)); }

std::string expert_prefix_of(std::string_view name) {
  return expert_prefix(block_of(name), group_of(name));
}

bool is_ln_gain(std::string_view name) {
  return name == kFinalLnW || (name.starts_with(kBlocks) &&
                               (name.ends_with(".ln1.w") || name.ends_with(".ln2.w")));
}

bool is_residual_projection(std::string_view name) {
  return name.starts_with(kBlocks) && (name.ends_with(".attn.out.w") || leaf_of(name) == kWOut);
}

}  // namespace sigma::names
