#include "serve/choice.h"

#include <algorithm>

namespace sigma::serve {

size_t utf8_complete_prefix(const std::string& s) {
  size_t i = s.size(), back = 0;
  while (i > 0 && back < 4 && (uint8_t(s[i - 1]) & 0xC0) == 0x80) --i, ++back;  // continuation bytes
  if (i == 0) return s.size();
  const uint8_t lead = uint8_t(s[i - 1]);
  const size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
  return back + 1 >= need ? s.size() : i - 1;
}

bool ChoiceText::apply(const TokenEvent& e) {
  if (done()) return false;
  if (!e.finish_reason.empty()) {
    finish_ = e.finish_reason;
    return true;
  }
  if (std::find(r_->stop_tokens.begin(), r_->stop_tokens.end(), e.token) != r_->stop_tokens.end())
    return false;  // the engine ends the choice next
  ids_.push_back(e.token);
  kept_.push_back(e);
  text_ = detokenize(*m_, ids_);
  size_t cut = std::string::npos;
  for (const std::string& s : r_->stop) cut = std::min(cut, text_.find(s));
  if (cut != std::string::npos) {
    text_.resize(cut);
    finish_ = "stop";
    return true;
  }
  return false;
}

std::string ChoiceText::take_ready() {
  size_t end = text_.size();
  if (!done()) {
    end = utf8_complete_prefix(text_);
    for (const std::string& s : r_->stop)  // a tail that may grow into a stop string waits
      for (size_t k = std::min(s.size() - 1, end); k > 0; --k)
        if (text_.compare(end - k, k, s, 0, k) == 0) {
          end -= k;
          break;
        }
  }
  if (end <= sent_) return "";
  std::string out = text_.substr(sent_, end - sent_);
  sent_ = end;
  return out;
}

}  // namespace sigma::serve
