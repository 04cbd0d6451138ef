// One choice of a generation request as the client sees it: the text of its tokens (stop
// tokens left out), cut at the first stop string, and how much of it may be sent yet (a
// stream holds back an incomplete UTF-8 character and a possible start of a stop string).
#pragma once
#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "serve/api.h"
#include "serve/engine.h"

namespace sigma::serve {

class ChoiceText {
 public:
  ChoiceText(const ServedModel& m, const GenerationRequest& r) : m_(&m), r_(&r) {}
  // Applies an engine event; returns true when it ended the choice (finish_reason() set).
  bool apply(const TokenEvent& e);
  bool done() const { return !finish_.empty(); }
  const std::string& finish_reason() const { return finish_; }
  const std::string& text() const { return text_; }
  const std::vector<int32_t>& ids() const { return ids_; }
  const std::vector<TokenEvent>& tokens() const { return kept_; }
  // The text not yet sent that may be sent now (all of it once done); marks it sent.
  std::string take_ready();

 private:
  const ServedModel* m_;
  const GenerationRequest* r_;
  std::vector<int32_t> ids_;
  std::vector<TokenEvent> kept_;  // tokens whose text is in text_
  std::string text_, finish_;
  size_t sent_ = 0;
};

// Bytes of s that form complete UTF-8 characters from the start.
size_t utf8_complete_prefix(const std::string& s);

}  // namespace sigma::serve
