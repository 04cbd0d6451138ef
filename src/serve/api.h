// The OpenAI-compatible request side (docs/serving.md): JSON bodies checked field by field into
// the engine's terms, and every refusal an ApiError (HTTP status, message naming the field),
// answered as {"error": {"message", "type", "param", "code"}}. A field that would change what a
// request means and that Sigma does not implement is refused, never ignored.
#pragma once
#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "infer/generate.h"
#include "model/config.h"
#include "model/domains.h"

namespace sigma::serve {

struct ApiError {
  ApiError(int status_, std::string message_, std::string param_ = "", std::string code_ = "")
      : status(status_), message(std::move(message_)), param(std::move(param_)), code(std::move(code_)) {}
  int status = 400;
  std::string message, param;
  std::string code;          // OpenAI's error code ("model_not_found"); empty: the status
  std::string type() const;  // "invalid_request_error", "authentication_error", ...
  nlohmann::json body() const;
};

// One model the server serves (the full checkpoint or an extract): its config, its tokenizer
// (null: prompts are token ids) and the limits requests are checked against.
struct ServedModel {
  std::string name;
  const ModelConfig* cfg = nullptr;
  const data::Tokenizer* tok = nullptr;
  // The data registry the checkpoint was trained with (null: none): a text prompt is formatted
  // as training and `sigma eval` format it, its domain's prefix controls (<Python>) first and a
  // bilingual domain's lines tagged; a prompt of token ids is taken as it is.
  const DomainRegistry* data_domains = nullptr;
  int max_tokens_limit = 4096;  // largest max_tokens a request may ask for
  int max_n = 8;                // largest n
};

struct GenerationRequest {
  bool chat = false;
  std::vector<int32_t> prompt;
  int domain = 0;
  SamplingConfig s;
  int n = 1;
  bool stream = false, echo = false, include_usage = false;
  int logprobs = -1;  // -1 = none; else top alternatives per token
  std::vector<std::string> stop;
  std::vector<int32_t> stop_tokens;
  std::vector<std::pair<int32_t, float>> logit_bias;  // added to the logits before sampling
  bool json_object = false;  // response_format json_object: constrained to one JSON object
};

// Which served model (index into the list) and domain (-1: the request's `domain` or the
// model's first) a request's `model` names: NAME, or NAME:DOMAIN for a domain of NAME. An
// unknown name is a 404 (code model_not_found); a missing `model` means the first model.
struct ModelRef {
  size_t model = 0;
  int domain = -1;
};
ModelRef resolve_model(const nlohmann::json& body, const std::vector<const ServedModel*>& models);
// The ids /v1/models lists for a model: NAME, then NAME:DOMAIN per domain.
std::vector<std::string> model_ids(const ServedModel& m);

// Checks the body of /v1/completions (chat = false) or /v1/chat/completions for model `m`;
// `domain` from resolve_model. Throws ApiError. Without a seed, draws a fresh one.
GenerationRequest parse_generation(const nlohmann::json& body, bool chat, const ServedModel& m, int domain);
// The JSON object of a request body (400 on malformed JSON, invalid UTF-8, overflowing numbers).
nlohmann::json parse_body(const std::string& body);
// The chat prompt text of a messages array (docs/serving.md: "role: content\n" ... "assistant:").
std::string chat_prompt(const nlohmann::json& messages);
// Text of token ids: the tokenizer's decoding, or the ids separated by spaces without one.
std::string detokenize(const ServedModel& m, const std::vector<int32_t>& ids);
// Token ids of a "prompt"/"text" field: a string (tokenized) or an array of ids.
std::vector<int32_t> tokens_of(const nlohmann::json& v, const ServedModel& m, const char* param);
// A generation's prompt: tokens_of, a text formatted for model domain `domain` (ServedModel::data_domains).
std::vector<int32_t> prompt_tokens(const nlohmann::json& v, const ServedModel& m, const char* param, int domain);
// A token as logprobs show it: its text when that is valid UTF-8, else OpenAI's
// "bytes:\xe2\x80" form, so that distinct tokens never share a label.
std::string token_label(const ServedModel& m, int32_t id);
// Characters (code points; a partial character counts once, at its first byte) in `bytes`.
size_t utf8_chars(const std::string& bytes);

}  // namespace sigma::serve
