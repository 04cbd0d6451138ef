#include "serve/api.h"

#include <fmt/format.h>

#include <cmath>

#include "core/json_depth.h"

namespace sigma::serve {
namespace {

using nlohmann::json;

ApiError bad(const std::string& param, const std::string& message) { return {400, message, param}; }

// Optional number field in [lo, hi]; `integer` refuses fractions.
template <class T>
T number(const json& j, const char* key, T fallback, double lo, double hi, bool integer) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  const json& v = j[key];
  if (!v.is_number() || (integer && !v.is_number_integer()))
    throw bad(key, fmt::format("'{}' must be {}, not {}", key, integer ? "an integer" : "a number",
                               v.type_name()));
  const double x = v.get<double>();
  if (!(x >= lo && x <= hi))
    throw bad(key, fmt::format("'{}' = {} is out of range [{}, {}]", key, v.dump(), lo, hi));
  return v.get<T>();
}

bool boolean(const json& j, const char* key, bool fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_boolean()) throw bad(key, fmt::format("'{}' must be a boolean, not {}", key, j[key].type_name()));
  return j[key].get<bool>();
}

std::vector<std::string> stop_strings(const json& j) {
  if (!j.contains("stop") || j["stop"].is_null()) return {};
  const json& v = j["stop"];
  if (v.is_string()) return {v.get<std::string>()};
  if (!v.is_array() || v.size() > 4)
    throw bad("stop", "'stop' must be a string or an array of up to 4 strings");
  std::vector<std::string> out;
  for (const json& s : v) {
    if (!s.is_string() || s.get<std::string>().empty())
      throw bad("stop", "'stop' entries must be non-empty strings");
    out.push_back(s.get<std::string>());
  }
  return out;
}

int domain_of(const json& j, const ModelConfig& cfg) {
  if (!j.contains("domain") || j["domain"].is_null()) return 0;
  if (!j["domain"].is_string()) throw bad("domain", "'domain' must be a string");
  const std::string name = j["domain"].get<std::string>();
  for (size_t i = 0; i < cfg.domains.size(); ++i)
    if (cfg.domains[i].name == name) return int(i);
  std::string known;
  for (const auto& d : cfg.domains) known += (known.empty() ? "" : ", ") + d.name;
  throw bad("domain", fmt::format("unknown domain '{}' (this model has: {})", name, known));
}

void sampling(const json& j, GenerationRequest& r, const ServedModel& m) {
  SamplingConfig& s = r.s;
  s.max_new_tokens = number<int>(j, "max_tokens", 16, 0, m.max_tokens_limit, true);
  s.temperature = number<float>(j, "temperature", 1.0f, 0, 2, false);
  s.top_p = number<float>(j, "top_p", 1.0f, 0, 1, false);
  if (s.top_p <= 0) throw bad("top_p", "'top_p' must be > 0");
  s.top_k = number<int>(j, "top_k", 0, 0, 1e9, true);
  s.repetition_penalty = number<float>(j, "repetition_penalty", 1.0f, 0.01, 100, false);
  s.frequency_penalty = number<float>(j, "frequency_penalty", 0.0f, -2, 2, false);
  s.presence_penalty = number<float>(j, "presence_penalty", 0.0f, -2, 2, false);
  s.seed = number<uint64_t>(j, "seed", 0, 0, 1.8e19, true);
  r.n = number<int>(j, "n", 1, 1, m.max_n, true);
  r.stream = boolean(j, "stream", false);
}

}  // namespace

std::string ApiError::type() const {
  if (status == 401) return "authentication_error";
  if (status == 404) return "not_found_error";
  if (status == 503) return "overloaded_error";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}

nlohmann::json ApiError::body() const {
  return {{"error", {{"message", message}, {"type", type()},
                     {"param", param.empty() ? json(nullptr) : json(param)}, {"code", status}}}};
}

json parse_body(const std::string& body) {
  json j;
  try {
    j = json::parse(body, json_depth_limit("the body"));
  } catch (const json::parse_error& e) {  // also ill-formed UTF-8 inside strings
    throw ApiError{400, fmt::format("the body is not valid JSON: {}", e.what()), ""};
  } catch (const Error& e) {  // nested too deep
    throw ApiError{400, e.what(), ""};
  }
  if (!j.is_object()) throw ApiError{400, "the body must be a JSON object", ""};
  return j;
}

std::string chat_prompt(const json& messages) {
  if (!messages.is_array() || messages.empty())
    throw bad("messages", "'messages' must be a non-empty array");
  std::string text;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string where = fmt::format("messages[{}]", i);
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content") ||
        !m["content"].is_string())
      throw bad(where, where + " must be an object with string 'role' and 'content'");
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant")
      throw bad(where, fmt::format("{} has role '{}' (system, user or assistant)", where, role));
    text += role + ": " + m["content"].get<std::string>() + "\n";
  }
  return text + "assistant:";
}

std::vector<int32_t> tokens_of(const json& v, const ServedModel& m, const char* param) {
  std::vector<int32_t> ids;
  if (v.is_string()) {
    if (!m.tok)
      throw bad(param, fmt::format("this model has no tokenizer: '{}' must be an array of token ids", param));
    for (uint32_t id : m.tok->encode(v.get<std::string>())) ids.push_back(int32_t(id));
    return ids;
  }
  if (!v.is_array()) throw bad(param, fmt::format("'{}' must be a string or an array of token ids", param));
  for (const json& t : v) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= m.cfg->vocab)
      throw bad(param, fmt::format("'{}' holds {}, not a token id in [0, {})", param, t.dump(), m.cfg->vocab));
    ids.push_back(t.get<int32_t>());
  }
  return ids;
}

std::string detokenize(const ServedModel& m, const std::vector<int32_t>& ids) {
  if (m.tok) {
    std::vector<uint32_t> u(ids.begin(), ids.end());
    return m.tok->decode(u);
  }
  std::string out;
  for (int32_t id : ids) out += fmt::format(" {}", id);
  return out;
}

GenerationRequest parse_generation(const std::string& body, bool chat, const ServedModel& m) {
  const json j = parse_body(body);
  GenerationRequest r;
  r.chat = chat;
  if (j.contains("model") && !j["model"].is_string()) throw bad("model", "'model' must be a string");
  r.domain = domain_of(j, *m.cfg);
  sampling(j, r, m);
  r.stop = stop_strings(j);
  if (chat) {
    if (!j.contains("messages")) throw bad("messages", "'messages' is required");
    if (!m.tok) throw bad("messages", "this model has no tokenizer, so it cannot chat");
    r.prompt = tokens_of(json(chat_prompt(j["messages"])), m, "messages");
    r.stop.push_back("\nuser:");
    if (boolean(j, "logprobs", false)) r.logprobs = number<int>(j, "top_logprobs", 0, 0, 20, true);
  } else {
    if (!j.contains("prompt")) throw bad("prompt", "'prompt' is required");
    json p = j["prompt"];
    if (p.is_array() && p.size() == 1 && p[0].is_string()) p = p[0];  // a batch of one prompt
    if (p.is_array() && !p.empty() && !p[0].is_number())
      throw bad("prompt", "one prompt per request: a string or an array of token ids");
    r.prompt = tokens_of(p, m, "prompt");
    r.echo = boolean(j, "echo", false);
    r.logprobs = number<int>(j, "logprobs", -1, 0, 20, true);
  }
  if (r.prompt.empty()) throw bad(chat ? "messages" : "prompt", "the prompt has no tokens");
  // Scoring alone (echo, max_tokens 0) feeds all but the last token: an evaluation window fits.
  const int64_t limit = m.cfg->context + (r.echo && r.s.max_new_tokens == 0 ? 1 : 0);
  if (int64_t(r.prompt.size()) > limit)
    throw bad(chat ? "messages" : "prompt",
              fmt::format("the prompt has {} tokens; the model's context is {}{}", r.prompt.size(),
                          m.cfg->context, limit > m.cfg->context ? " (+1 when only scoring)" : ""));
  if (m.tok) r.stop_tokens.push_back(int32_t(data::kEotId));
  return r;
}

}  // namespace sigma::serve
