// A nesting limit for JSON read from files and requests. nlohmann's parser is iterative, but
// copying, comparing and printing a value recurse once per level, so a file of a million nested
// arrays parses and then overflows the stack when an error message prints it. No Sigma file
// or request nests deeper than a few levels.
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <utility>

#include "core/error.h"

namespace sigma {

inline constexpr int kMaxJsonDepth = 64;

// Parser callback for nlohmann::json::parse: throws sigma::Error naming `where` past the limit.
inline nlohmann::json::parser_callback_t json_depth_limit(std::string where) {
  return [where = std::move(where)](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
    SIGMA_CHECK(depth <= kMaxJsonDepth, "{}: JSON nested deeper than {} levels", where, kMaxJsonDepth);
    return true;
  };
}

// json::parse(input, nullptr, false) with the limit: a discarded value when the input is
// malformed or nests deeper than kMaxJsonDepth, for readers that report or count bad input
// themselves (a JSONL line, a metrics record, a file they name in their own error).
template <class Input>
nlohmann::json parse_json_or_discard(Input&& input) {
  bool deep = false;
  nlohmann::json j = nlohmann::json::parse(
      std::forward<Input>(input),
      [&deep](int depth, nlohmann::json::parse_event_t, nlohmann::json&) {
        deep = deep || depth > kMaxJsonDepth;
        return !deep;  // a discarded value is not built, so a deep input costs no recursion
      },
      /*allow_exceptions=*/false);
  return deep ? nlohmann::json(nlohmann::json::value_t::discarded) : j;
}

}  // namespace sigma
