#include "serve/json_prefix.h"

namespace sigma::serve {
namespace {

bool space(uint8_t c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
bool digit(uint8_t c) { return c >= '0' && c <= '9'; }
bool hex(uint8_t c) { return digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

// Number sub-states: what the bytes so far are.
enum Num : uint8_t { Minus, Zero, Int, Dot, Frac, E, ESign, Exp };
bool num_can_end(uint8_t s) { return s == Zero || s == Int || s == Frac || s == Exp; }

}  // namespace

bool JsonPrefix::push(std::string_view bytes) {
  const JsonPrefix saved = *this;
  for (char ch : bytes) {
    const uint8_t c = uint8_t(ch);
    const bool blank = space(c) && mode_ != Mode::String;  // inside a literal step() refuses it
    if ((blank && space_run_ == kMaxSpaceRun) || !step(c)) {
      *this = saved;
      return false;
    }
    space_run_ = blank ? uint8_t(space_run_ + 1) : 0;
  }
  return true;
}

void JsonPrefix::end_value() { mode_ = depth_ == 0 ? Mode::Done : Mode::After; }

bool JsonPrefix::value_start(uint8_t c) {
  if (c == '{' || c == '[') {
    if (depth_ == kMaxDepth) return false;
    stack_[size_t(depth_++)] = char(c);
    mode_ = c == '{' ? Mode::KeyOrClose : Mode::ValueOrClose;
    return true;
  }
  if (c == '"') {
    mode_ = Mode::String, key_ = false;
    return true;
  }
  if (c == '-' || digit(c)) {
    mode_ = Mode::Number;
    num_ = c == '-' ? Minus : c == '0' ? Zero : Int;
    return true;
  }
  static const char* const literals[] = {"true", "false", "null"};
  for (const char* l : literals)
    if (c == uint8_t(l[0])) {
      mode_ = Mode::Literal, literal_ = l + 1;
      return true;
    }
  return false;
}

bool JsonPrefix::step(uint8_t c) {
  switch (mode_) {
    case Mode::Start:
      if (space(c)) return true;
      return c == '{' && value_start(c);
    case Mode::Done:
      return space(c);
    case Mode::KeyOrClose:
    case Mode::Key:
      if (space(c)) return true;
      if (c == '"') {
        mode_ = Mode::String, key_ = true;
        return true;
      }
      if (c == '}' && mode_ == Mode::KeyOrClose) {
        --depth_;
        end_value();
        return true;
      }
      return false;
    case Mode::Colon:
      if (space(c)) return true;
      if (c != ':') return false;
      mode_ = Mode::Value;
      return true;
    case Mode::ValueOrClose:
      if (c == ']') {
        --depth_;
        end_value();
        return true;
      }
      [[fallthrough]];
    case Mode::Value:
      if (space(c)) return true;
      return value_start(c);
    case Mode::After:
      if (space(c)) return true;
      if (c == ',') {
        mode_ = stack_[size_t(depth_ - 1)] == '{' ? Mode::Key : Mode::Value;
        return true;
      }
      if ((c == '}' && stack_[size_t(depth_ - 1)] == '{') || (c == ']' && stack_[size_t(depth_ - 1)] == '[')) {
        --depth_;
        end_value();
        return true;
      }
      return false;
    case Mode::String:
      if (utf8_left_ > 0) {
        if ((c & 0xC0) != 0x80) return false;
        --utf8_left_;
        return true;
      }
      if (escape_ == 1) {
        if (c == 'u') return escape_ = 5, true;
        if (c != '"' && c != '\\' && c != '/' && c != 'b' && c != 'f' && c != 'n' && c != 'r' && c != 't') return false;
        escape_ = 0;
        return true;
      }
      if (escape_ > 1) {
        if (!hex(c)) return false;
        escape_ = escape_ == 2 ? 0 : uint8_t(escape_ - 1);
        return true;
      }
      if (c == '\\') return escape_ = 1, true;
      if (c == '"') {
        if (key_) mode_ = Mode::Colon;
        else end_value();
        return true;
      }
      if (c < 0x20 || c == 0x7F) return false;
      if (c < 0x80) return true;
      if (c >= 0xC2 && c <= 0xDF) return utf8_left_ = 1, true;
      if (c >= 0xE0 && c <= 0xEF) return utf8_left_ = 2, true;
      if (c >= 0xF0 && c <= 0xF4) return utf8_left_ = 3, true;
      return false;
    case Mode::Number:
      switch (num_) {
        case Minus: if (c == '0') return num_ = Zero, true; if (digit(c)) return num_ = Int, true; return false;
        case Zero: break;
        case Int: if (digit(c)) return true; break;
        case Dot: if (digit(c)) return num_ = Frac, true; return false;
        case Frac: if (digit(c)) return true; break;
        case E: if (c == '+' || c == '-') return num_ = ESign, true; if (digit(c)) return num_ = Exp, true; return false;
        case ESign: if (digit(c)) return num_ = Exp, true; return false;
        case Exp: if (digit(c)) return true; break;
      }
      if (c == '.' && (num_ == Zero || num_ == Int)) return num_ = Dot, true;
      if ((c == 'e' || c == 'E') && (num_ == Zero || num_ == Int || num_ == Frac)) return num_ = E, true;
      if (!num_can_end(num_)) return false;
      end_value();  // the number ended: this byte belongs to what follows it
      return step(c);
    case Mode::Literal:
      if (c != uint8_t(*literal_)) return false;
      if (*++literal_ == '\0') end_value();
      return true;
  }
  return false;
}

}  // namespace sigma::serve
