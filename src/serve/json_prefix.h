// Constrained decoding for response_format {"type": "json_object"}: a byte-level recogniser of
// the prefixes of one JSON object (RFC 8259, strings valid UTF-8, nesting at most kMaxDepth).
// The engine masks every token whose bytes would leave the language and ends the choice once the
// object is closed, so the text of a finished choice parses as a JSON object.
#pragma once
#include <array>
#include <cstdint>
#include <string_view>

namespace sigma::serve {

class JsonPrefix {
 public:
  static constexpr int kMaxDepth = 32;
  // Whitespace bytes in a row outside strings: enough for a newline and indentation four levels
  // deep, too few for a model to spend its tokens on blanks (unbounded, 13 of 16 requests of a
  // small model ran to max_tokens with 72 % of the text whitespace).
  static constexpr int kMaxSpaceRun = 9;
  // Feeds bytes; false (and the state unchanged) when they cannot continue a JSON object.
  bool push(std::string_view bytes);
  // The top-level object is closed (only whitespace may follow).
  bool complete() const { return mode_ == Mode::Done; }

 private:
  enum class Mode : uint8_t {
    Start,       // before the top-level '{'
    KeyOrClose,  // after '{': a key or '}'
    Key,         // after ',' in an object: a key
    Colon,       // after a key
    ValueOrClose,  // after '[': a value or ']'
    Value,       // after ':' or ',' in an array
    After,       // after a value: ',' or the closer
    String,      // inside a string (key_ says which kind)
    Number,
    Literal,     // inside true / false / null
    Done,
  };
  bool step(uint8_t c);
  bool value_start(uint8_t c);
  void end_value();
  std::array<char, kMaxDepth> stack_{};  // '{' or '['
  int depth_ = 0;
  Mode mode_ = Mode::Start;
  bool key_ = false;        // the string being read is a key
  uint8_t escape_ = 0;      // 0, 1 after '\', 2..5 hex digits of \uXXXX still due (5 = 4 due)
  uint8_t utf8_left_ = 0;   // continuation bytes still due in a string
  uint8_t space_run_ = 0;   // whitespace bytes in a row just before, outside strings
  uint8_t num_ = 0;         // number sub-state (json_prefix.cpp)
  const char* literal_ = nullptr;  // the rest of a literal still due
};

}  // namespace sigma::serve
