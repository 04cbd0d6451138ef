#include "serve/api.h"

#include "data/prepare.h"

#include <fmt/format.h>

#include <cmath>
#include <mutex>
#include <random>
#include <set>

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

// "stop": a string or up to 4; an empty string stops nothing (it would otherwise match at once
// and empty every completion).
std::vector<std::string> stop_strings(const json& j) {
  if (!j.contains("stop") || j["stop"].is_null()) return {};
  const json& v = j["stop"];
  json list = v.is_string() ? json::array({v}) : v;
  if (!list.is_array() || list.size() > 4)
    throw bad("stop", "'stop' must be a string or an array of up to 4 strings");
  std::vector<std::string> out;
  for (const json& s : list) {
    if (!s.is_string()) throw bad("stop", "'stop' entries must be strings");
    if (!s.get<std::string>().empty()) out.push_back(s.get<std::string>());
  }
  return out;
}

std::string domain_list(const ModelConfig& cfg) {
  std::string known;
  for (const auto& d : cfg.domains) known += (known.empty() ? "" : ", ") + d.name;
  return known;
}

int find_domain(const ModelConfig& cfg, const std::string& name) {
  for (size_t i = 0; i < cfg.domains.size(); ++i)
    if (cfg.domains[i].name == name) return int(i);
  return -1;
}

// The request's domain: `domain` (an extension field, kept as a synonym) and the one `model`
// named must agree; neither: the model's first.
int domain_of(const json& j, const ModelConfig& cfg, int from_model) {
  if (!j.contains("domain") || j["domain"].is_null()) return std::max(from_model, 0);
  if (!j["domain"].is_string()) throw bad("domain", "'domain' must be a string");
  const std::string name = j["domain"].get<std::string>();
  const int d = find_domain(cfg, name);
  if (d < 0) throw bad("domain", fmt::format("unknown domain '{}' (this model has: {})", name, domain_list(cfg)));
  if (from_model >= 0 && d != from_model)
    throw bad("domain", fmt::format("'domain' is '{}' but 'model' names domain '{}'", name,
                                    cfg.domains[size_t(from_model)].name));
  return d;
}

// Fields a generation request may carry; any other is refused by name (an ignored field would
// silently change what the client asked for).
const std::set<std::string>& known_fields(bool chat) {
  static const std::set<std::string> common = {
      "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n", "stream",
      "stream_options", "logprobs", "stop", "presence_penalty", "frequency_penalty", "repetition_penalty",
      "logit_bias", "seed", "user", "domain", "response_format"};
  static const std::set<std::string> completion = [] {
    auto s = common;
    s.insert({"prompt", "echo", "best_of", "suffix"});
    return s;
  }();
  static const std::set<std::string> chat_fields = [] {
    auto s = common;
    s.insert({"messages", "top_logprobs", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls"});
    return s;
  }();
  return chat ? chat_fields : completion;
}

// Fields that are accepted only at the value that means "not used".
void refuse_unsupported(const json& j, bool chat) {
  for (const auto& [key, v] : j.items())
    if (!known_fields(chat).count(key))
      throw bad(key, fmt::format("unsupported field '{}' (docs/serving.md lists the fields)", key));
  auto unused = [&](const char* key, auto&& is_unused, const char* why) {
    if (j.contains(key) && !j[key].is_null() && !is_unused(j[key])) throw bad(key, fmt::format("'{}' {}", key, why));
  };
  unused("best_of", [&](const json& v) { return v == json(1) || (j.contains("n") && v == j["n"]); },
         "is not supported (only 1 or n: each choice is sampled once, none is discarded)");
  unused("suffix", [](const json& v) { return v == json(""); }, "is not supported (no insertion mode)");
  unused("tools", [](const json& v) { return v.is_array() && v.empty(); }, "is not supported (no tool calls)");
  unused("functions", [](const json& v) { return v.is_array() && v.empty(); }, "is not supported (no tool calls)");
  unused("tool_choice", [](const json& v) { return v == json("none"); }, "is not supported (no tool calls)");
  unused("function_call", [](const json& v) { return v == json("none"); }, "is not supported (no tool calls)");
  unused("parallel_tool_calls", [](const json& v) { return v.is_boolean(); }, "must be a boolean");
  unused("user", [](const json& v) { return v.is_string(); }, "must be a string");
}

void sampling(const json& j, GenerationRequest& r, const ServedModel& m) {
  SamplingConfig& s = r.s;
  s.max_new_tokens = number<int>(j, "max_tokens", 16, 0, m.max_tokens_limit, true);
  if (j.contains("max_completion_tokens") && !j["max_completion_tokens"].is_null()) {
    const int mc = number<int>(j, "max_completion_tokens", 16, 0, m.max_tokens_limit, true);
    if (j.contains("max_tokens") && !j["max_tokens"].is_null() && mc != s.max_new_tokens)
      throw bad("max_completion_tokens", "'max_completion_tokens' and 'max_tokens' disagree");
    s.max_new_tokens = mc;
  }
  s.temperature = number<float>(j, "temperature", 1.0f, 0, 2, false);
  s.top_p = number<float>(j, "top_p", 1.0f, 0, 1, false);
  if (s.top_p <= 0) throw bad("top_p", "'top_p' must be > 0");
  s.top_k = number<int>(j, "top_k", 0, 0, 1e9, true);
  s.repetition_penalty = number<float>(j, "repetition_penalty", 1.0f, 0.01, 100, false);
  s.frequency_penalty = number<float>(j, "frequency_penalty", 0.0f, -2, 2, false);
  s.presence_penalty = number<float>(j, "presence_penalty", 0.0f, -2, 2, false);
  if (j.contains("seed") && !j["seed"].is_null()) {
    s.seed = number<uint64_t>(j, "seed", 0, 0, 1.8e19, true);
  } else {  // no seed: fresh entropy, so retries and pass@k get distinct samples
    static std::mutex m_;
    static std::random_device dev;
    std::lock_guard<std::mutex> lock(m_);
    s.seed = (uint64_t(dev()) << 32) ^ dev();
  }
  r.n = number<int>(j, "n", 1, 1, m.max_n, true);
  r.stream = boolean(j, "stream", false);
  if (j.contains("stream_options") && !j["stream_options"].is_null()) {
    const json& o = j["stream_options"];
    if (!r.stream) throw bad("stream_options", "'stream_options' is only allowed with 'stream': true");
    if (!o.is_object()) throw bad("stream_options", "'stream_options' must be an object");
    for (const auto& [key, v] : o.items())
      if (key != "include_usage") throw bad("stream_options", fmt::format("unsupported field 'stream_options.{}'", key));
    r.include_usage = boolean(o, "include_usage", false);
  }
}

void logit_bias(const json& j, GenerationRequest& r, const ServedModel& m) {
  if (!j.contains("logit_bias") || j["logit_bias"].is_null()) return;
  const json& b = j["logit_bias"];
  if (!b.is_object() || b.size() > 1024)
    throw bad("logit_bias", "'logit_bias' must be an object of at most 1024 token ids to biases");
  for (const auto& [key, v] : b.items()) {
    char* end = nullptr;
    const long id = std::strtol(key.c_str(), &end, 10);
    if (key.empty() || *end != '\0' || id < 0 || id >= m.cfg->vocab)
      throw bad("logit_bias", fmt::format("'logit_bias' key '{}' is not a token id in [0, {})", key.substr(0, 32), m.cfg->vocab));
    if (!v.is_number() || !(v.get<double>() >= -100 && v.get<double>() <= 100))
      throw bad("logit_bias", fmt::format("'logit_bias' value for {} must be a number in [-100, 100]", id));
    r.logit_bias.emplace_back(int32_t(id), v.get<float>());
  }
}

void response_format(const json& j, GenerationRequest& r, const ServedModel& m) {
  if (!j.contains("response_format") || j["response_format"].is_null()) return;
  const json& f = j["response_format"];
  if (!f.is_object() || !f.contains("type") || !f["type"].is_string())
    throw bad("response_format", "'response_format' must be an object with a string 'type'");
  const std::string type = f["type"].get<std::string>();
  if (type == "text") return;
  if (type != "json_object")
    throw bad("response_format", fmt::format("response_format type '{}' is not supported (text or json_object)", type));
  if (f.size() != 1) throw bad("response_format", "response_format json_object takes no other field");
  if (!m.tok) throw bad("response_format", "json_object needs a model with a tokenizer");
  r.json_object = true;
}

}  // namespace

ModelRef resolve_model(const json& j, const std::vector<const ServedModel*>& models) {
  if (!j.contains("model") || j["model"].is_null()) return {};
  if (!j["model"].is_string()) throw bad("model", "'model' must be a string");
  const std::string want = j["model"].get<std::string>();
  for (size_t i = 0; i < models.size(); ++i) {
    const ServedModel& m = *models[i];
    if (want == m.name) return {i, -1};
    if (want.size() > m.name.size() + 1 && want.compare(0, m.name.size(), m.name) == 0 && want[m.name.size()] == ':') {
      const int d = find_domain(*m.cfg, want.substr(m.name.size() + 1));
      if (d >= 0) return {i, d};
    }
  }
  std::string known;
  for (const ServedModel* m : models)
    for (const std::string& id : model_ids(*m)) known += (known.empty() ? "" : ", ") + id;
  throw ApiError{404, fmt::format("the model '{}' does not exist (this server has: {})", want.substr(0, 200), known),
                 "model", "model_not_found"};
}

std::vector<std::string> model_ids(const ServedModel& m) {
  std::vector<std::string> ids = {m.name};
  for (const auto& d : m.cfg->domains) ids.push_back(m.name + ":" + d.name);
  return ids;
}

std::string token_label(const ServedModel& m, int32_t id) {
  if (!m.tok) return fmt::format(" {}", id);
  const std::string& b = m.tok->token_bytes(uint32_t(id));
  // Valid UTF-8 (no partial character): the text itself.
  bool valid = true;
  for (size_t i = 0; i < b.size() && valid;) {
    const uint8_t c = uint8_t(b[i]);
    const size_t len = c < 0x80 ? 1 : (c >= 0xC2 && c <= 0xDF) ? 2 : (c >= 0xE0 && c <= 0xEF) ? 3 : (c >= 0xF0 && c <= 0xF4) ? 4 : 0;
    if (len == 0 || i + len > b.size()) valid = false;
    for (size_t k = 1; valid && k < len; ++k)
      if ((uint8_t(b[i + k]) & 0xC0) != 0x80) valid = false;
    i += len;
  }
  if (valid) return b;
  std::string out = "bytes:";
  for (unsigned char c : b) out += fmt::format("\\x{:02x}", c);
  return out;
}

size_t utf8_chars(const std::string& bytes) {
  size_t n = 0;
  for (unsigned char c : bytes) n += (c & 0xC0) != 0x80;
  return n;
}

std::string ApiError::type() const {
  if (status == 401) return "authentication_error";
  if (status == 404) return "not_found_error";
  if (status == 503) return "overloaded_error";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}

nlohmann::json ApiError::body() const {
  return {{"error", {{"message", message}, {"type", type()},
                     {"param", param.empty() ? json(nullptr) : json(param)},
                     {"code", code.empty() ? json(status) : json(code)}}}};
}

json parse_body(const std::string& body) {
  json j;
  try {
    j = json::parse(body, json_depth_limit("the body"));
  } catch (const json::parse_error& e) {  // also ill-formed UTF-8 inside strings
    throw ApiError{400, fmt::format("the body is not valid JSON: {}", e.what()), ""};
  } catch (const json::exception& e) {  // a number past double's range (1e400)
    throw ApiError{400, fmt::format("the body has a number out of range: {}", e.what()), ""};
  } catch (const Error& e) {  // nested too deep
    throw ApiError{400, e.what(), ""};
  }
  if (!j.is_object()) throw ApiError{400, "the body must be a JSON object", ""};
  return j;
}

namespace {

// A message's content: a string, or an array of parts as the SDKs send it; the text parts are
// joined with newlines, and other parts (images, audio) are refused by name.
std::string message_text(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array())
    throw bad(where, where + "'s 'content' must be a string or an array of {\"type\": \"text\", \"text\": ...} parts");
  std::string text;
  for (size_t k = 0; k < content.size(); ++k) {
    const json& part = content[k];
    const std::string at = fmt::format("{}.content[{}]", where, k);
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      throw bad(at, at + " must be an object with a string 'type'");
    if (part["type"] != "text")
      throw bad(at, fmt::format("{} is of type '{}'; this server takes only text parts", at,
                                part["type"].get<std::string>().substr(0, 32)));
    if (!part.contains("text") || !part["text"].is_string()) throw bad(at, at + " must have a string 'text'");
    text += (k ? "\n" : "") + part["text"].get<std::string>();
  }
  return text;
}

}  // namespace

std::string chat_prompt(const json& messages) {
  if (!messages.is_array() || messages.empty())
    throw bad("messages", "'messages' must be a non-empty array");
  std::string text;
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string where = fmt::format("messages[{}]", i);
    if (!m.is_object() || !m.contains("role") || !m["role"].is_string() || !m.contains("content"))
      throw bad(where, where + " must be an object with string 'role' and 'content'");
    std::string role = m["role"].get<std::string>();
    if (role == "developer") role = "system";  // OpenAI's newer name for the system message
    if (role != "system" && role != "user" && role != "assistant")
      throw bad(where, fmt::format("{} has role '{}' (system, developer, user or assistant)", where, role));
    text += role + ": " + message_text(m["content"], where) + "\n";
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

std::vector<int32_t> prompt_tokens(const json& v, const ServedModel& m, const char* param, int domain) {
  const DomainSpec* spec = m.data_domains && m.tok && v.is_string() && domain >= 0 &&
                                   size_t(domain) < m.cfg->domains.size()
                               ? m.data_domains->find(m.cfg->domains[size_t(domain)].name)
                               : nullptr;
  if (!spec) return tokens_of(v, m, param);
  std::vector<uint32_t> ids;
  data::format_sample(*m.tok, *spec, v.get<std::string>(), "", ids);
  ids.pop_back();  // <EOT>
  return std::vector<int32_t>(ids.begin(), ids.end());
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

GenerationRequest parse_generation(const json& j, bool chat, const ServedModel& m, int domain) {
  GenerationRequest r;
  r.chat = chat;
  refuse_unsupported(j, chat);
  r.domain = domain_of(j, *m.cfg, domain);
  sampling(j, r, m);
  logit_bias(j, r, m);
  response_format(j, r, m);
  r.stop = stop_strings(j);
  if (chat) {
    if (!j.contains("messages")) throw bad("messages", "'messages' is required");
    if (!m.tok) throw bad("messages", "this model has no tokenizer, so it cannot chat");
    r.prompt = prompt_tokens(json(chat_prompt(j["messages"])), m, "messages", r.domain);
    r.stop.push_back("\nuser:");
    if (boolean(j, "logprobs", false)) r.logprobs = number<int>(j, "top_logprobs", 0, 0, 20, true);
    else if (j.contains("top_logprobs") && !j["top_logprobs"].is_null())
      throw bad("top_logprobs", "'top_logprobs' needs 'logprobs': true");
  } else {
    if (!j.contains("prompt")) throw bad("prompt", "'prompt' is required");
    json p = j["prompt"];
    if (p.is_array() && p.size() == 1 && p[0].is_string()) p = p[0];  // a batch of one prompt
    if (p.is_array() && !p.empty() && !p[0].is_number())
      throw bad("prompt", "one prompt per request: a string or an array of token ids");
    r.prompt = prompt_tokens(p, m, "prompt", r.domain);
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
