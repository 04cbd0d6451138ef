// The one domain registry (model/domains.h): the model config's `model.domains` and the data's
// data.json / shard manifests are read by the same reader and differ only in their form.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "model/domains.h"

using namespace sigma;
using nlohmann::json;

namespace {

std::string error_of(const std::string& text, DomainForm form) {
  try {
    DomainRegistry::from_json(json::parse(text), "x.domains", form);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(DomainRegistry, TheFormsDifferOnlyInDefaultsAndChecks) {
  const char* text = R"([{"name": "en"}, {"name": "py", "group": "code", "id": 7,
                         "prefix": ["<Python>"], "format": "bilingual"}])";
  const DomainRegistry m = DomainRegistry::from_json(json::parse(text), "m", DomainForm::Model);
  const DomainRegistry d = DomainRegistry::from_json(json::parse(text), "d", DomainForm::Data);
  for (const DomainRegistry* r : {&m, &d}) {
    ASSERT_EQ(r->size(), 2u);
    EXPECT_EQ(r->at("en").group, "en");
    EXPECT_EQ(r->at("en").id, 0u);
    EXPECT_EQ(r->at("py").id, 7u);
    EXPECT_EQ(r->at("py").prefix, std::vector<std::string>{"<Python>"});
    EXPECT_EQ(r->at("py").format, SampleFormat::Bilingual);
    EXPECT_EQ(r->index("py"), 1);
  }
  EXPECT_EQ(m.at("py").slot, 0);  // a model config shares slot 0 unless told
  EXPECT_EQ(d.at("py").slot, 7);  // a data registry gives each domain its id's slot
  // An empty list is a model config's "take the domains from the data".
  EXPECT_TRUE(DomainRegistry::from_json(json::array(), "m", DomainForm::Model).empty());
  EXPECT_NE(error_of("[]", DomainForm::Data).find("non-empty array"), std::string::npos);
  // Shards are files named after their domain; a model config's names are not file names.
  EXPECT_EQ(error_of(R"([{"name": "a/b"}])", DomainForm::Model), "");
  EXPECT_NE(error_of(R"([{"name": "a/b"}])", DomainForm::Data).find("file name"),
            std::string::npos);
}

TEST(DomainRegistry, WritesTheModelFormAndTheWholeRecordForData) {
  DomainRegistry r{{"a", "g", 1}};
  r[0].id = 4;
  r[0].prefix = {"<Java>"};
  EXPECT_EQ(r.to_json(DomainForm::Model),
            json::parse(R"([{"name": "a", "group": "g", "slot": 1}])"));
  // Prepare hashes this text to decide whether a shard is current: it must not change.
  EXPECT_EQ(to_json(r[0], DomainForm::Data).dump(),
            R"({"format":"plain","group":"g","id":4,"name":"a","prefix":["<Java>"],"slot":1})");
  for (DomainForm f : {DomainForm::Model, DomainForm::Data})
    EXPECT_EQ(DomainRegistry::from_json(r.to_json(f), "x", f).to_json(f), r.to_json(f));
}

TEST(DomainRegistry, ErrorsNameTheKeyAndIndexInBothForms) {
  for (DomainForm f : {DomainForm::Model, DomainForm::Data}) {
    auto err = [&](const char* text) { return error_of(text, f); };
    EXPECT_NE(err(R"([{"name": "a"}, {"name": "b", "group": 3}])").find("x.domains[1].group"),
              std::string::npos);
    EXPECT_NE(err(R"([{"name": "a", "slot": -1}])").find("x.domains[0].slot"), std::string::npos);
    EXPECT_NE(err(R"([{"name": "a", "id": 70000}])").find("x.domains[0].id"), std::string::npos);
    EXPECT_NE(err(R"([{"group": "a"}])").find("x.domains[0].name"), std::string::npos);
    EXPECT_NE(err(R"([{"name": "a"}, {"name": "a"}])").find("declared twice"), std::string::npos);
    EXPECT_NE(err(R"([{"name": "a", "id": 1}, {"name": "b"}])").find("already used"),
              std::string::npos);
    EXPECT_NE(err(R"([{"name": "a", "colour": 1}])").find("\"colour\""), std::string::npos);
    EXPECT_NE(err(R"({"name": "a"})").find("array"), std::string::npos);
  }
  EXPECT_THROW(DomainRegistry{}.at("a"), Error);
}

TEST(DomainRegistry, ModelConfigReadsAndWritesItsForm) {
  ModelConfig c;
  Options o;
  c.describe(o, "model.");
  o.apply_json(json::parse(R"({"model": {"domains": [{"name": "a", "slot": 1},
                                          {"name": "b", "id": 3, "prefix": ["<P>"]}]}})"),
               "test.json");
  ASSERT_EQ(c.domains.size(), 2u);
  EXPECT_EQ(c.domains[0].group, "a");
  EXPECT_EQ(c.domains[0].slot, 1);
  EXPECT_EQ(c.domains[1].slot, 0);
  EXPECT_EQ(c.domain_index("b"), 1);
  EXPECT_EQ(o.to_json()["model"]["domains"],
            json::parse(R"([{"name": "a", "group": "a", "slot": 1},
                            {"name": "b", "group": "b", "slot": 0}])"));
}
