// A nesting limit for JSON read from files and requests. nlohmann's parser is iterative, but
// copying, comparing and printing a value recurse once per level, so a file of a million nested
// arrays parses and then overflows the stack when an error message prints it. No Sigma file
// or request nests deeper than a few levels.
#pragma once
#include <nlohmann/json.hpp>

#include <string>

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

}  // namespace sigma
