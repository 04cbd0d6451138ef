// The OpenAI-compatible request side (docs/serving.md): JSON bodies checked field by field into
// the engine's terms, and every refusal an ApiError (HTTP status, message naming the field),
// answered as {"error": {"message", "type", "param", "code"}}.
#pragma once
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "infer/generate.h"
#include "model/config.h"

namespace sigma::serve {

struct ApiError {
  int status = 400;
  std::string message, param;
  std::string type() const;  // "invalid_request_error", "authentication_error", ...
  nlohmann::json body() const;
};

// What the server serves: the model's config, its tokenizer (null: prompts are token ids) and
// the limits requests are checked against.
struct ServedModel {
  std::string name;
  const ModelConfig* cfg = nullptr;
  const data::Tokenizer* tok = nullptr;
  int max_tokens_limit = 4096;  // largest max_tokens a request may ask for
  int max_n = 8;                // largest n
};

struct GenerationRequest {
  bool chat = false;
  std::vector<int32_t> prompt;
  int domain = 0;
  SamplingConfig s;
  int n = 1;
  bool stream = false, echo = false;
  int logprobs = -1;  // -1 = none; else top alternatives per token
  std::vector<std::string> stop;
  std::vector<int32_t> stop_tokens;
};

// Parses the body of /v1/completions (chat = false) or /v1/chat/completions; throws ApiError.
GenerationRequest parse_generation(const std::string& body, bool chat, const ServedModel& m);
// The JSON object of a request body (400 on malformed JSON or invalid UTF-8).
nlohmann::json parse_body(const std::string& body);
// The chat prompt text of a messages array (docs/serving.md: "role: content\n" ... "assistant:").
std::string chat_prompt(const nlohmann::json& messages);
// Text of token ids: the tokenizer's decoding, or the ids separated by spaces without one.
std::string detokenize(const ServedModel& m, const std::vector<int32_t>& ids);
// Token ids of a "prompt"/"text" field: a string (tokenized) or an array of ids.
std::vector<int32_t> tokens_of(const nlohmann::json& v, const ServedModel& m, const char* param);

}  // namespace sigma::serve
