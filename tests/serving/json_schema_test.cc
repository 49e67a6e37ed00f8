// JSON-Schema-constrained decoding: the grammar engine (serving/structured/grammar.h) on hand grammars; the
// schema compiler (serving/structured/json_schema.h) against a small validator written here, by random walks
// through the grammar (every finished document must validate), mutations of valid documents
// (those the validator refuses the matcher must refuse) and hand cases; errors for what is
// outside the subset; the mask on the stories260K vocabulary against the matcher run over every
// token, and stories260K through the Scheduler writing documents that validate.
#include "serving/structured/json_schema.h"

#include <gtest/gtest.h>

#include <algorithm>

#include <chrono>
#include <nlohmann/json.hpp>
#include <random>

#include "core/model/gguf.h"
#include "core/model/model_loader.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "serving/scheduler.h"
#include "serving/structured/grammar.h"
#include "tests/core/tier_test_util.h"

namespace specontext {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;
using E = GrammarElement;
using Step = GrammarMatcher::Step;

std::shared_ptr<const Grammar> built(const GrammarBuilder& b, uint32_t root) {
  auto g = b.build(root);
  EXPECT_TRUE(g.is_ok()) << g.status().to_string();
  if (!g.is_ok()) return nullptr;
  return std::make_shared<const Grammar>(std::move(*g));
}

GrammarMatcher start(std::shared_ptr<const Grammar> g) {
  auto m = GrammarMatcher::create(std::move(g));
  EXPECT_TRUE(m.is_ok()) << m.status().to_string();
  return std::move(*m);
}

// Whether the whole text is a sentence of the grammar.
bool sentence(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  GrammarMatcher m = start(g);
  return m.advance(text) == Step::kOk && m.accepting();
}

TEST(Grammar, AlternativesAndSequences) {
  GrammarBuilder b;
  const uint32_t x = b.add("x", {GrammarBuilder::literal("x"), {E::range('0', '2')}});
  const uint32_t s = b.add("s", {GrammarBuilder::literal("ab"),
                                 GrammarBuilder::literal("cd"),
                                 {E::byte('a'), E::ref(x)},
                                 {E::not_set(E::range('a', 'z').bytes)}});
  auto g = built(b, s);
  ASSERT_NE(g, nullptr);
  for (std::string_view ok : {"ab", "cd", "ax", "a1", "Q", "\xff"}) EXPECT_TRUE(sentence(g, ok)) << ok;
  for (std::string_view bad : {"", "a", "ac", "a3", "abc", "q", "cdx"}) EXPECT_FALSE(sentence(g, bad)) << bad;
  GrammarMatcher m = start(g);
  EXPECT_FALSE(m.accepting());
  EXPECT_EQ(m.advance(std::string_view("ac")), Step::kRefused);  // all or nothing
  EXPECT_TRUE(m.next_bytes().test('c'));
  ASSERT_EQ(m.advance(std::string_view("a")), Step::kOk);
  EXPECT_EQ(m.stack_count(), 3u);  // "ab", and "a" x with x's two alternatives
  EXPECT_TRUE(m.next_bytes().test('b') && m.next_bytes().test('x') && m.next_bytes().test('1'));
  EXPECT_FALSE(m.next_bytes().test('a'));
  ASSERT_EQ(m.advance(std::string_view("b")), Step::kOk);
  EXPECT_TRUE(m.accepting());
  EXPECT_TRUE(m.closed());
  EXPECT_EQ(m.advance(std::string_view("b")), Step::kRefused);
}

TEST(Grammar, RepetitionCompilesToHelperRules) {
  GrammarBuilder b;
  auto r24 = b.repeat({E::byte('a')}, 2, 4, "a24");
  ASSERT_TRUE(r24.is_ok());
  const uint32_t st = b.star(GrammarBuilder::literal("xy"), "xy*");
  const uint32_t pl = b.plus({E::byte('z')}, "z+");
  const uint32_t op = b.optional({E::byte('-')}, "-?");
  auto r3 = b.repeat({E::range('0', '9')}, 3, std::nullopt, "d3+");
  ASSERT_TRUE(r3.is_ok());
  const uint32_t s = b.add("s", {{E::byte('A'), E::ref(*r24)},
                                 {E::byte('S'), E::ref(st), E::byte('.')},
                                 {E::byte('P'), E::ref(pl)},
                                 {E::byte('O'), E::ref(op), E::byte('1')},
                                 {E::byte('D'), E::ref(*r3)}});
  auto g = built(b, s);
  ASSERT_NE(g, nullptr);
  for (std::string_view ok :
       {"Aaa", "Aaaa", "Aaaaa", "S.", "Sxy.", "Sxyxyxy.", "Pz", "Pzzzz", "O1", "O-1", "D123", "D12345678"}) {
    EXPECT_TRUE(sentence(g, ok)) << ok;
  }
  for (std::string_view bad : {"Aa", "Aaaaaa", "Sx.", "Sxyx.", "P", "O--1", "D12", "D1a3"}) {
    EXPECT_FALSE(sentence(g, bad)) << bad;
  }
  GrammarMatcher m = start(g);
  ASSERT_EQ(m.advance(std::string_view("Aaa")), Step::kOk);
  EXPECT_TRUE(m.accepting());
  EXPECT_FALSE(m.closed());  // two more may come
  ASSERT_EQ(m.advance(std::string_view("aa")), Step::kOk);
  EXPECT_TRUE(m.closed());
  // Bounds are checked.
  EXPECT_EQ(b.repeat({E::byte('a')}, 3, 2, "bad").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(b.repeat({E::byte('a')}, 0, GrammarBuilder::kMaxRepeat + 1, "big").status().code(),
            StatusCode::kInvalidArgument);
  // A long bounded repetition keeps one stack per position (no growth with the count).
  GrammarBuilder lb;
  auto many = lb.repeat({E::byte('a')}, 0, 4000, "a4000");
  ASSERT_TRUE(many.is_ok());
  GrammarMatcher lm = start(built(lb, *many));
  ASSERT_EQ(lm.advance(std::string(4000, 'a')), Step::kOk);
  EXPECT_TRUE(lm.closed());
}

TEST(Grammar, LeftRecursionAndBrokenRulesAreRefused) {
  {
    GrammarBuilder b;
    const uint32_t s = b.declare("expr");
    b.define(s, {{E::ref(s), E::byte('+'), E::byte('1')}, {E::byte('1')}});
    auto g = b.build(s);
    ASSERT_FALSE(g.is_ok());
    EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(g.status().message().find("left recursion through 'expr' -> 'expr'"), std::string::npos)
        << g.status().message();
  }
  {  // indirect, through a nullable rule
    GrammarBuilder b;
    const uint32_t a = b.declare("a");
    const uint32_t maybe = b.add("maybe", {{}, {E::byte('b')}});
    const uint32_t c = b.add("c", {{E::ref(maybe), E::ref(a)}});
    b.define(a, {{E::ref(c), E::byte('x')}, {E::byte('y')}});
    auto g = b.build(a);
    ASSERT_FALSE(g.is_ok());
    EXPECT_NE(g.status().message().find("left recursion"), std::string::npos) << g.status().message();
    EXPECT_NE(g.status().message().find("'c'"), std::string::npos) << g.status().message();
  }
  {  // right recursion is fine
    GrammarBuilder b;
    const uint32_t s = b.declare("list");
    b.define(s, {{E::byte('1'), E::byte(','), E::ref(s)}, {E::byte('1')}});
    EXPECT_TRUE(b.build(s).is_ok());
  }
  {
    GrammarBuilder b;
    const uint32_t s = b.declare("never");
    EXPECT_NE(b.build(s).status().message().find("never defined"), std::string::npos);
    b.define(s, {});
    EXPECT_NE(b.build(s).status().message().find("no alternative"), std::string::npos);
    b.define(s, {{E::set({})}});
    EXPECT_NE(b.build(s).status().message().find("empty byte set"), std::string::npos);
    b.define(s, {{E::ref(99)}});
    EXPECT_NE(b.build(s).status().message().find("refers to no rule"), std::string::npos);
    EXPECT_FALSE(b.build(7).is_ok());
  }
}

TEST(Grammar, ExplodingStacksAreRefusedAndDeepNestingBounded) {
  // s ::= "a" s x | "a" s y | ε: after n a's, 2^n distinct stacks.
  GrammarBuilder b;
  const uint32_t s = b.declare("s");
  const uint32_t x = b.add("x", {GrammarBuilder::literal("x")});
  const uint32_t y = b.add("y", {GrammarBuilder::literal("y")});
  b.define(s, {{E::byte('a'), E::ref(s), E::ref(x)}, {E::byte('a'), E::ref(s), E::ref(y)}, {}});
  GrammarMatcher m = start(built(b, s));
  ASSERT_EQ(m.advance(std::string_view("aaa")), Step::kOk);
  EXPECT_TRUE(m.accepts("xyx"));
  Step last = Step::kOk;
  int fed = 3;
  for (; fed < 40 && last == Step::kOk; ++fed) last = m.advance(std::string_view("a"));
  EXPECT_EQ(last, Step::kExhausted);
  EXPECT_LE(fed, 14);
  EXPECT_LE(m.stack_count(), GrammarMatcher::kMaxStacks);  // left as it was before the refused byte
  // Nesting deeper than the stack depth cap is refused, not followed.
  GrammarBuilder nb;
  const uint32_t p = nb.declare("paren");
  nb.define(p, {{E::byte('('), E::ref(p), E::byte(')')}, {}});
  GrammarMatcher pm = start(built(nb, p));
  size_t taken = 0;
  while (taken < 3000 && pm.advance(std::string_view("(")) == Step::kOk) ++taken;
  EXPECT_GE(taken, 1000u);
  EXPECT_LT(taken, 3000u);
  EXPECT_TRUE(pm.accepts(std::string(taken, ')')));
}

// ---- a validator for the supported subset (independent of the compiler) ----

const json* resolve(const json& root, const std::string& ref) {
  if (ref == "#") return &root;
  for (std::string section : {"$defs", "definitions"}) {
    const std::string prefix = "#/" + section + "/";
    if (ref.rfind(prefix, 0) == 0 && root.contains(section) &&
        root[section].contains(ref.substr(prefix.size()))) {
      return &root[section][ref.substr(prefix.size())];
    }
  }
  return nullptr;
}

size_t code_points(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

bool valid(const json& v, const json& s, const json& root) {
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) {
    const json* t = resolve(root, s["$ref"].get<std::string>());
    if (t == nullptr || !valid(v, *t, root)) return false;
  }
  if (s.contains("anyOf")) {
    bool any = false;
    for (const json& a : s["anyOf"]) any |= valid(v, a, root);
    if (!any) return false;
  }
  if (s.contains("oneOf")) {
    int n = 0;
    for (const json& a : s["oneOf"]) n += valid(v, a, root) ? 1 : 0;
    if (n != 1) return false;
  }
  if (s.contains("allOf")) {
    for (const json& a : s["allOf"]) {
      if (!valid(v, a, root)) return false;
    }
  }
  if (s.contains("enum") && std::find(s["enum"].begin(), s["enum"].end(), v) == s["enum"].end()) return false;
  if (s.contains("const") && s["const"] != v) return false;
  if (s.contains("type")) {
    const json types = s["type"].is_array() ? s["type"] : json::array({s["type"]});
    bool any = false;
    for (const json& t : types) {
      const std::string n = t.get<std::string>();
      any |= (n == "object" && v.is_object()) || (n == "array" && v.is_array()) ||
             (n == "string" && v.is_string()) || (n == "integer" && v.is_number_integer()) ||
             (n == "number" && v.is_number()) || (n == "boolean" && v.is_boolean()) ||
             (n == "null" && v.is_null());
    }
    if (!any) return false;
  }
  if (v.is_object()) {
    const json props = s.value("properties", json::object());
    for (const json& r : s.value("required", json::array())) {
      if (!v.contains(r.get<std::string>())) return false;
    }
    for (const auto& [k, x] : v.items()) {
      if (props.contains(k)) {
        if (!valid(x, props[k], root)) return false;
      } else if (s.contains("additionalProperties") && !valid(x, s["additionalProperties"], root)) {
        return false;
      }
    }
  }
  if (v.is_array()) {
    const json prefix = s.value("prefixItems", json::array());
    for (size_t i = 0; i < v.size(); ++i) {
      if (i < prefix.size()) {
        if (!valid(v[i], prefix[i], root)) return false;
      } else if (s.contains("items") && !valid(v[i], s["items"], root)) {
        return false;
      }
    }
    if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return false;
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return false;
  }
  if (v.is_string()) {
    const size_t n = code_points(v.get<std::string>());
    if (s.contains("minLength") && n < s["minLength"].get<size_t>()) return false;
    if (s.contains("maxLength") && n > s["maxLength"].get<size_t>()) return false;
  }
  return true;
}

// The validator's verdict on a text: parses and validates.
bool text_valid(const std::string& text, const json& schema) {
  try {
    return valid(json::parse(text), schema, schema);
  } catch (const json::exception&) {
    return false;
  }
}

struct Case {
  const char* schema;
  std::vector<std::string> valid_docs;
  std::vector<std::string> invalid_docs;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> k = {
      {R"({"type":"object","properties":{"name":{"type":"string","maxLength":12},"age":{"type":"integer"}},
          "required":["name","age"],"additionalProperties":false})",
       {R"({"name":"Al","age":3})", R"({"name": "x", "age": -12})", R"({"name":"123456789012","age":0})"},
       {R"({"name":"Al"})", R"({"name":"Al","age":"3"})", R"({"name":"Al","age":3,"x":1})",
        R"({"name":"Al","age":3.5})", R"({"name":"1234567890123","age":1})", R"({})"}},
      {R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"string"},"c":{"type":"boolean"}},
          "required":["b"],"additionalProperties":false})",
       {R"({"b":""})", R"({"a":1,"b":"x"})", R"({"b":"x","c":true})", R"({"a":1, "b":"x", "c":false})"},
       {R"({})", R"({"a":1})", R"({"a":1,,"b":"x"})", R"({,"b":"x"})", R"({"b":"x",})",
        R"({"a":1,"c":true})"}},
      {R"({"type":"object","properties":{"a":{"type":"integer"},"b":{"type":"integer"},"c":{"type":"integer"}},
          "additionalProperties":false})",
       {R"({})", R"({"a":1})", R"({"b":2})", R"({"c":3})", R"({"a":1,"c":3})", R"({"b":2,"c":3})",
        R"({"a":1,"b":2,"c":3})"},
       {R"({,})", R"({"a":1,})", R"({"d":1})", R"({"a":"1"})"}},
      {R"({"type":"array","items":{"type":"integer"},"minItems":2,"maxItems":4})",
       {"[1,2]", "[1, 2, 3, 4]", "[0,-1,2]"},
       {"[]", "[1]", "[1,2,3,4,5]", R"([1,"a"])", "[1,2,]"}},
      {R"({"enum":["red","green",1,null,{"a":[1,2]}]})",
       {R"("red")", "1", "null", R"({"a":[1,2]})"},
       {R"("blue")", "2", R"({"a":[1]})"}},
      {R"({"anyOf":[{"type":"string","maxLength":3},{"type":"integer"},{"type":"null"}]})",
       {R"("abc")", "42", "null", R"("")"},
       {R"("abcd")", "true", "1.5"}},
      {R"({"$defs":{"node":{"type":"object","properties":{"v":{"type":"integer"},
            "kids":{"type":"array","items":{"$ref":"#/$defs/node"},"maxItems":3}},"required":["v"],
            "additionalProperties":false}},"$ref":"#/$defs/node"})",
       {R"({"v":1})", R"({"v":1,"kids":[{"v":2},{"v":3,"kids":[]}]})",
        R"({"v":1,"kids":[{"v":2,"kids":[{"v":3}]}]})"},
       {R"({"kids":[]})", R"({"v":1,"kids":[{}]})", R"({"v":1,"kids":[{"v":1},{"v":1},{"v":1},{"v":1}]})"}},
      {R"({"type":"string","minLength":2,"maxLength":5})",
       {R"("ab")", "\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"", R"("\u00e9\n")", R"("\ud83d\ude00x")",
        R"("a\"\\/")"},
       {R"("a")", R"("abcdef")", R"("\ud83d\ude00")", R"("\ud83d")", "\"\xc3\"", "\"a\x01\""}},
      {R"({"type":"integer"})", {"0", "-7", "1234567890123456"}, {"01", "1.5", "-", R"("1")", "1e3"}},
      {R"({"type":"number"})", {"0", "-1.5", "2e10", "3.25E-7", "1e+5"}, {".5", "1.", "1e", "+1", "--1"}},
      {R"({"type":["boolean","null"]})", {"true", "false", "null"}, {"0", R"("true")", "nul"}},
      {R"(true)",
       {R"({"a":[1,{"b":null}],"c":"x"})", "[]", R"("s")", "-0.5e-3", "[[],{}]"},
       {"[1,]", "{\"a\"}"}},
      {R"({"type":"object","properties":{"id":{"type":"integer"}},"required":["id"],
          "additionalProperties":{"type":"string"}})",
       {R"({"id":1})", R"({"id":1,"x":"y"})", R"({"id":1, "idx":"y", "i":"z", "":"e"})",
        R"({"id":1,"\n":"y"})"},
       {R"({"id":1,"x":2})", R"({"id":1,"id":"s"})", R"({"x":"y"})"}},
      {R"({"type":"object"})", {R"({})", R"({"a":1,"b":[true]})"}, {"[]", R"({"a"})", R"({"a":1,})"}},
      {R"({"type":"array","prefixItems":[{"type":"string"},{"type":"integer"}],"items":false})",
       {"[]", R"(["a"])", R"(["a",1])"},
       {"[1]", R"(["a","b"])", R"(["a",1,2])"}},
      {R"({"type":"array","prefixItems":[{"const":"x"}],"items":{"type":"boolean"},"minItems":2,"maxItems":3})",
       {R"(["x",true])", R"(["x",false,true])"},
       {R"(["x"])", R"(["x",true,true,true])", R"(["y",true])", "[]"}},
      {R"({"oneOf":[{"type":"object","properties":{"kind":{"const":"a"},"n":{"type":"integer"}},
            "required":["kind","n"],"additionalProperties":false},
          {"type":"object","properties":{"kind":{"const":"b"},"s":{"type":"string"}},
            "required":["kind","s"],"additionalProperties":false}]})",
       {R"({"kind":"a","n":1})", R"({"kind":"b","s":""})"},
       {R"({"kind":"a","s":""})", R"({"kind":"c","n":1})"}},
      {R"({"type":"object","properties":{"user":{"type":"object","properties":{"first":{"type":"string"},
            "last":{"type":"string"}},"required":["last"],"additionalProperties":false},
          "tags":{"type":"array","items":{"type":"string","maxLength":4},"maxItems":2}},"additionalProperties":false})",
       {R"({})", R"({"tags":["ab","cd"]})", R"({"user":{"last":"x"},"tags":[]})",
        R"({"user":{"first":"a","last":"b"}})"},
       {R"({"user":{}})", R"({"tags":["abcde"]})", R"({"tags":["a","b","c"]})",
        R"({"user":{"last":"x","mid":"y"}})"}},
      {R"({"definitions":{"color":{"enum":["r","g"]}},"type":"object","properties":{"c":{"allOf":[{"$ref":"#/definitions/color"}]}},
          "required":["c"],"additionalProperties":false})",
       {R"({"c":"r"})", R"({"c":"g"})"},
       {R"({"c":"b"})", R"({})"}},
      {R"({"type":["string","integer"],"enum":["a",1,true]})", {R"("a")", "1"}, {"true", R"("b")"}},
      {R"({"type":"object","required":["k"],"additionalProperties":{"type":"integer"}})",
       {R"({"k":1})", R"({"k":1,"z":2})"},
       {R"({})", R"({"z":2})", R"({"k":"s"})", R"({"k":1,"k":"s"})"}},
      {R"({"type":"array","items":{"anyOf":[{"type":"number"},{"type":"array","items":{"type":"null"},"maxItems":1}]},"maxItems":3})",
       {"[]", "[1.5,[null],[]]", "[[]]"},
       {"[[null,null]]", "[1,2,3,4]", R"(["x"])"}},
  };
  return k;
}

std::shared_ptr<const Grammar> compile(const std::string& schema_text) {
  auto g = json_schema_to_grammar(ordered_json::parse(schema_text));
  EXPECT_TRUE(g.is_ok()) << g.status().to_string() << " for " << schema_text;
  if (!g.is_ok()) return nullptr;
  return std::make_shared<const Grammar>(std::move(*g));
}

TEST(JsonSchema, HandCasesAreAcceptedOrRefused) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.schema);
    const json schema = json::parse(c.schema);
    auto g = compile(c.schema);
    ASSERT_NE(g, nullptr);
    for (const std::string& d : c.valid_docs) {
      EXPECT_TRUE(text_valid(d, schema)) << "the validator refuses " << d;
      EXPECT_TRUE(sentence(g, d)) << "refused: " << d;
    }
    for (const std::string& d : c.invalid_docs) {
      EXPECT_FALSE(text_valid(d, schema)) << "the validator accepts " << d;
      EXPECT_FALSE(sentence(g, d)) << "accepted: " << d;
    }
  }
}

// Trees built by a caller (parsing is iterative, so they can be any depth): before the depth check
// the sorted overload's dump, and dumps of const / enum values, recursed per level and
// overflowed the stack. A tree deeper than kMaxJsonDepth is refused before anything walks it.
TEST(JsonSchema, SchemasNestedTooDeepAreRefusedBeforeAnythingRecurses) {
  const std::string deep = std::string(150000, '[') + std::string(150000, ']');
  const json sorted = json::parse(R"({"const":)" + deep + "}");
  const ordered_json in_order = ordered_json::parse(R"({"enum":[)" + deep + "]}");
  for (const Result<Grammar>& g : {json_schema_to_grammar(sorted), json_schema_to_grammar(in_order)}) {
    ASSERT_FALSE(g.is_ok());
    EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(g.status().message().find("deeper than 128 levels"), std::string::npos) << g.status().message();
  }
  // 128 levels compile (a const of 127 arrays inside the schema object).
  const std::string ok = std::string(127, '[') + std::string(127, ']');
  EXPECT_TRUE(json_schema_to_grammar(ordered_json::parse(R"({"const":)" + ok + "}")).is_ok());
  EXPECT_FALSE(json_schema_to_grammar(ordered_json::parse(R"({"const":[)" + ok + "]}")).is_ok());
}

// Each enum value is a parse stack where the value begins, beside one for the optional space
// before it: past GrammarMatcher::kMaxStacks the matcher cannot go on. Before, 1024 values
// compiled and the matcher refused the byte before the value (kExhausted); now the compiler names
// the keyword and the limit, kMaxEnumValues = 1023.
TEST(JsonSchema, AnEnumPastTheMatchersLimitIsRefusedNamingTheLimit) {
  auto schema = [](int n) {
    ordered_json values = ordered_json::array();
    for (int i = 0; i < n; ++i) {
      std::string v = "v";  // appended: GCC 12 warns falsely (-Wrestrict) on "v" + std::string
      v += std::to_string(i);
      values.push_back(v);
    }
    return ordered_json{{"type", "object"},
                        {"properties", {{"k", {{"enum", values}}}}},
                        {"required", {"k"}},
                        {"additionalProperties", false}};
  };
  auto ok = json_schema_to_grammar(schema(1023));
  ASSERT_TRUE(ok.is_ok()) << ok.status().message();
  auto m = GrammarMatcher::create(std::make_shared<const Grammar>(std::move(*ok)));
  ASSERT_TRUE(m.is_ok()) << m.status().message();
  ASSERT_EQ(m->advance(std::string_view(R"({"k": ")")), Step::kOk);
  EXPECT_EQ(m->advance(std::string_view(R"(v1022"})")), Step::kOk);
  EXPECT_TRUE(m->closed());
  auto refused = json_schema_to_grammar(schema(1024));
  ASSERT_FALSE(refused.is_ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(
      refused.status().message().find("'enum' at /properties/k has 1024 values; at most 1023 are supported"),
      std::string::npos)
      << refused.status().message();
}

// A schema built in code holds counts as signed integers (ordered_json{{"minItems", 1}}); they
// count as the same non-negative integers a parsed document holds.
TEST(JsonSchema, BuiltDocumentsCountLikeParsedOnes) {
  const ordered_json built = {{"type", "array"}, {"minItems", 1}, {"maxItems", 2}};
  ASSERT_TRUE(json_schema_to_grammar(built).is_ok()) << json_schema_to_grammar(built).status().message();
  const ordered_json negative = {{"type", "array"}, {"minItems", -1}};
  ASSERT_FALSE(json_schema_to_grammar(negative).is_ok());
  EXPECT_NE(json_schema_to_grammar(negative).status().message().find("non-negative"), std::string::npos);
}

// Random walks: pick any allowed next byte (printable ASCII and some UTF-8 bytes) until the
// matcher closes, or accepts and a coin says stop. Every such document must validate.
TEST(JsonSchema, RandomWalksWriteValidDocuments) {
  std::vector<uint8_t> alphabet;
  for (int b = 0x20; b < 0x7f; ++b) alphabet.push_back(static_cast<uint8_t>(b));
  for (uint8_t b : {0xC3, 0xA9, 0xE2, 0x82, 0xAC, 0xF0, 0x9F, 0x98, 0x80}) alphabet.push_back(b);
  std::mt19937 rng(11);
  int documents = 0, closed = 0, abandoned = 0;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.schema);
    const json schema = json::parse(c.schema);
    auto g = compile(c.schema);
    ASSERT_NE(g, nullptr);
    const GrammarMatcher initial = start(g);
    for (int walk = 0; walk < 60; ++walk) {
      GrammarMatcher m = initial;
      std::string text;
      bool done = false;
      while (text.size() < 4000) {
        if (m.closed()) {
          ++closed;
          done = true;
          break;
        }
        if (m.accepting() && rng() % 3 == 0) {
          done = true;
          break;
        }
        const std::bitset<256> next = m.next_bytes();
        std::vector<uint8_t> options;
        for (uint8_t b : alphabet) {
          if (next.test(b)) options.push_back(b);
        }
        ASSERT_FALSE(options.empty()) << "stuck after " << text;
        // Now and then a closing byte, so that strings and containers end.
        std::vector<uint8_t> closers;
        for (uint8_t b : options) {
          if (b == '"' || b == '}' || b == ']') closers.push_back(b);
        }
        const uint8_t b = !closers.empty() && rng() % 4 == 0 ? closers[rng() % closers.size()]
                                                             : options[rng() % options.size()];
        ASSERT_EQ(m.advance(b), Step::kOk) << text << " + " << static_cast<int>(b);
        text += static_cast<char>(b);
      }
      if (!done) {
        ++abandoned;
        continue;
      }
      ++documents;
      EXPECT_TRUE(text_valid(text, schema)) << "invalid document: " << text;
    }
  }
  std::printf("[ stats    ] %d documents (%d closed), %d walks abandoned\n", documents, closed, abandoned);
  EXPECT_GT(documents, 20 * 55);
  EXPECT_GT(closed, 200);
  EXPECT_LT(abandoned, 20);
}

// Mutations of valid documents that the validator refuses must be refused (or left unfinished).
TEST(JsonSchema, MutationsTheValidatorRefusesAreRefused) {
  const char alphabet[] = "{}[]\",:.-+eE0123456789 \\utrfnalxyzkvbcdsi\x01\xc3\xa9";
  std::mt19937 rng(3);
  int refused = 0;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.schema);
    const json schema = json::parse(c.schema);
    auto g = compile(c.schema);
    ASSERT_NE(g, nullptr);
    for (const std::string& doc : c.valid_docs) {
      for (int m = 0; m < 150; ++m) {
        std::string mutant = doc;
        for (int edits = 1 + static_cast<int>(rng() % 2); edits > 0 && !mutant.empty(); --edits) {
          const size_t at = rng() % mutant.size();
          const char ch = alphabet[rng() % (sizeof alphabet - 1)];
          switch (rng() % 3) {
            case 0:
              mutant[at] = ch;
              break;
            case 1:
              mutant.insert(mutant.begin() + static_cast<std::ptrdiff_t>(at), ch);
              break;
            default:
              mutant.erase(at, 1);
              break;
          }
        }
        if (text_valid(mutant, schema)) continue;
        ++refused;
        EXPECT_FALSE(sentence(g, mutant)) << "accepted an invalid mutant: " << mutant;
      }
    }
  }
  EXPECT_GT(refused, 3000);
}

TEST(JsonSchema, OutsideTheSubsetIsAnErrorNamingKeywordAndPointer) {
  const std::pair<const char*, const char*> bad[] = {
      {R"({"type":"object","properties":{"name":{"type":"string","pattern":"a+"}}})",
       "unsupported keyword 'pattern' at /properties/name"},
      {R"({"type":"string","format":"date"})", "unsupported keyword 'format' at the root"},
      {R"({"type":"integer","minimum":1})", "unsupported keyword 'minimum' at the root"},
      {R"({"type":"array","items":{"type":"integer","not":{}}})", "unsupported keyword 'not' at /items"},
      {R"({"type":"array","uniqueItems":true})", "unsupported keyword 'uniqueItems' at the root"},
      {R"({"properties":{"a/b":{"if":{}}}})", "unsupported keyword 'if' at /properties/a~1b"},
      {R"({"patternProperties":{}})", "unsupported keyword 'patternProperties'"},
      {R"({"type":"object","minProperties":1})", "unsupported keyword 'minProperties'"},
      {R"({"anyOf":[{"$ref":"http://example.com/s.json"}]})",
       "unsupported $ref 'http://example.com/s.json' at /anyOf/0"},
      {R"({"$ref":"#/$defs/missing"})", "$ref '#/$defs/missing' at the root names no definition"},
      {R"({"$ref":5})", "'$ref' at the root must be a string"},
      {R"({"type":5})", "'type' at the root must be a string or an array of strings"},
      {R"({"type":"wat"})", "unknown type 'wat' at the root"},
      {R"({"type":"object","required":"a"})", "'required' at the root must be an array of strings"},
      {R"({"type":"object","properties":[]})", "'properties' at the root must be an object"},
      {R"({"type":"object","properties":{"a":{}},"required":["a","b"]})", "required property 'b'"},
      {R"({"type":"string","minLength":-1})", "'minLength' at the root must be a non-negative integer"},
      {R"({"type":"string","maxLength":2.5})", "'maxLength' at the root must be a non-negative integer"},
      {R"({"type":"array","maxItems":100000})", "'maxItems' at the root above 4096 is not supported"},
      {R"({"type":"array","minItems":3,"maxItems":2})", "no array can match"},
      {R"({"type":"string","minLength":3,"maxLength":2})", "no string can match"},
      {R"({"allOf":[{},{}]})", "'allOf' of more than one schema"},
      {R"({"anyOf":[]})", "'anyOf' at /anyOf must be a non-empty array"},
      {R"({"type":"object","anyOf":[{}]})", "'anyOf' beside 'type' at the root is not supported"},
      {R"({"enum":[1],"minLength":2})", "'enum' beside 'minLength'"},
      {R"({"type":"string","enum":[1,2]})", "no value of 'type' is in the enum"},
      {R"({"items":[{}]})", "'items' as an array at the root is not supported"},
      {R"(false)", "no value can match the schema false at the root"},
      {R"({"properties":{"a":false},"required":["a"]})", "no value can match required property 'a'"},
      {R"("object")", "the schema at the root must be an object or a boolean"},
      {R"({"$defs":{"a":{"$ref":"#/$defs/a"}},"$ref":"#/$defs/a"})", "left recursion"},
      {R"({"type":"object","properties":{"\u00e9":{}},"additionalProperties":true})", "printable ASCII"},
  };
  for (const auto& [schema, message] : bad) {
    SCOPED_TRACE(schema);
    auto g = json_schema_to_grammar(ordered_json::parse(schema));
    ASSERT_FALSE(g.is_ok());
    EXPECT_EQ(g.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(g.status().message().find(message), std::string::npos) << g.status().message();
    EXPECT_EQ(g.status().message().rfind("JSON schema: ", 0), 0u) << g.status().message();
  }
  // Deep nesting is an error, not a stack overflow.
  std::string deep;
  for (int i = 0; i < 500; ++i) deep += R"({"items":)";
  deep += "{}";
  for (int i = 0; i < 500; ++i) deep += "}";
  EXPECT_NE(json_schema_to_grammar(ordered_json::parse(deep)).status().message().find("deeper"),
            std::string::npos);
  // Descriptive keywords are ignored; the plain-json overload sorts properties.
  auto described = json_schema_to_grammar(ordered_json::parse(
      R"({"title":"t","description":"d","$schema":"x","$id":"y","examples":[1],"default":1,"$comment":"c","type":"integer"})"));
  EXPECT_TRUE(described.is_ok()) << described.status().to_string();
  auto sorted = json_schema_to_grammar(json::parse(
      R"({"type":"object","properties":{"z":{"type":"integer"},"a":{"type":"integer"}},"required":["z","a"],
                      "additionalProperties":false})"));
  ASSERT_TRUE(sorted.is_ok());
  auto sg = std::make_shared<const Grammar>(std::move(*sorted));
  EXPECT_TRUE(sentence(sg, R"({"a":1,"z":2})"));
  EXPECT_FALSE(sentence(sg, R"({"z":2,"a":1})"));
  // Generation choices (documented in json_schema.h): declared order, no space before ','.
  auto c3 = compile(cases()[2].schema);
  EXPECT_TRUE(text_valid(R"({"b":2,"a":1})", json::parse(cases()[2].schema)));
  EXPECT_FALSE(sentence(c3, R"({"b":2,"a":1})"));
  EXPECT_FALSE(sentence(c3, R"({"a":1 ,"b":2})"));
  EXPECT_FALSE(sentence(c3, R"({"a":1,  "b":2})"));
  EXPECT_FALSE(sentence(c3, R"( {"a":1})"));
  auto kept = compile(
      R"({"type":"object","properties":{"z":{"type":"integer"},"a":{"type":"integer"}},"required":["z","a"],
                      "additionalProperties":false})");
  EXPECT_TRUE(sentence(kept, R"({"z":2,"a":1})"));
}

std::vector<bool> open_tokens(const TokenConstraint& c, size_t vocab) {
  std::vector<float> logits(vocab, 1.0f);
  EXPECT_TRUE(c.mask(logits).is_ok());
  std::vector<bool> open;
  for (float l : logits) open.push_back(l == 1.0f);
  return open;
}

TEST(JsonSchemaConstraint, ToyVocabularyMaskAcceptCloneAndDeadEnd) {
  //                                       0    1    2     3      4         5   6     7     8    9
  auto vocab =
      VocabularyBytes::from_pieces({"{", "}", "\"", "\"a\":", "\"a\": 1", "1", "", "12", "x", "{\"a\":"});
  const auto schema = ordered_json::parse(
      R"({"type":"object","properties":{"a":{"type":"integer"}},"required":["a"],"additionalProperties":false})");
  auto c = JsonSchemaConstraint::create(schema, vocab);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  using V = std::vector<bool>;
  EXPECT_EQ(open_tokens(**c, 10), (V{true, false, false, false, false, false, false, false, false, true}));
  EXPECT_EQ((*c)->accept(1).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ((*c)->accept(6).code(), StatusCode::kInvalidArgument);  // empty bytes (EOS): never
  EXPECT_EQ((*c)->accept(42).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE((*c)->accept(0).is_ok());
  EXPECT_EQ(open_tokens(**c, 10), (V{false, false, true, true, true, false, false, false, false, false}));
  auto copy = (*c)->clone();
  ASSERT_TRUE((*c)->accept(4).is_ok());
  EXPECT_EQ(open_tokens(**c, 10), (V{false, true, false, false, false, true, false, true, false, false}));
  ASSERT_TRUE((*c)->accept(1).is_ok());
  EXPECT_TRUE((*c)->closed());
  EXPECT_FALSE(copy->closed());
  std::vector<float> wide(14, 1.0f);  // logits past the vocabulary are masked
  ASSERT_TRUE(copy->mask(wide).is_ok());
  EXPECT_EQ(wide[12], -std::numeric_limits<float>::infinity());
  // Dead end: after {"a": the vocabulary has no digit.
  auto no_digits = VocabularyBytes::from_pieces({"{", "}", "\"a\":", "x"});
  auto d = JsonSchemaConstraint::create(schema, no_digits);
  ASSERT_TRUE(d.is_ok());
  ASSERT_TRUE((*d)->accept(0).is_ok());
  ASSERT_TRUE((*d)->accept(2).is_ok());
  std::vector<float> logits(4, 0.0f);
  EXPECT_EQ((*d)->mask(logits).code(), StatusCode::kOutOfRange);
  EXPECT_EQ(JsonSchemaConstraint::create(schema, nullptr).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(JsonSchemaConstraint::create(ordered_json::parse(R"({"format":"x"})"), vocab).status().code(),
            StatusCode::kInvalidArgument);
  // The trie is built once per vocabulary.
  EXPECT_EQ(VocabularyTrie::of(vocab).get(), VocabularyTrie::of(vocab).get());
}

struct Stories {
  std::unique_ptr<Tokenizer> tok;
  std::shared_ptr<const VocabularyBytes> vocabulary;
};

Stories load_stories() {
  auto model = load_model(testing::repo_path("models/stories260K/stories260K.bin"));
  EXPECT_TRUE(model.is_ok());
  auto tok = load_tokenizer_for(**model, testing::repo_path("models/stories260K/tok512.bin"));
  EXPECT_TRUE(tok.is_ok()) << tok.status().to_string();
  Stories s;
  s.tok = std::move(*tok);
  s.vocabulary = VocabularyBytes::build(*s.tok);
  return s;
}

// The trie walk allows exactly what running the matcher over each token's bytes allows, at every
// step of real documents in a real vocabulary.
TEST(JsonSchemaConstraint, TheMaskEqualsTheMatcherRunOverEveryToken) {
  const Stories st = load_stories();
  const auto& bytes = st.vocabulary->bytes;
  int steps = 0;
  double mask_us = 0;
  for (const Case& c : cases()) {
    for (const std::string& doc : c.valid_docs) {
      SCOPED_TRACE(doc);
      // Longest tokens first (the tokenizer's own encoding adds a dummy-prefix space).
      std::vector<TokenId> ids;
      for (size_t at = 0; at < doc.size();) {
        size_t best = 0, len = 0;
        for (size_t t = 0; t < bytes.size(); ++t) {
          if (bytes[t].size() > len && doc.compare(at, bytes[t].size(), bytes[t]) == 0) {
            best = t;
            len = bytes[t].size();
          }
        }
        ASSERT_GT(len, 0u);
        ids.push_back(static_cast<TokenId>(best));
        at += len;
      }
      auto con = JsonSchemaConstraint::create(ordered_json::parse(c.schema), st.vocabulary);
      ASSERT_TRUE(con.is_ok()) << con.status().to_string();
      for (TokenId id : ids) {
        std::vector<float> logits(bytes.size(), 0.0f);
        const auto t0 = std::chrono::steady_clock::now();
        ASSERT_TRUE((*con)->mask(logits).is_ok());
        mask_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
        for (size_t t = 0; t < logits.size(); ++t) {
          const bool brute = !bytes[t].empty() && (*con)->matcher().accepts(bytes[t]);
          ASSERT_EQ(logits[t] == 0.0f, brute) << "token " << t << " '" << bytes[t] << "'";
        }
        ASSERT_TRUE((*con)->accept(id).is_ok());
        ++steps;
      }
      EXPECT_TRUE((*con)->matcher().accepting());
    }
  }
  EXPECT_GT(steps, 300);
  std::printf("[ stats    ] %d masks over %zu tokens: %.1f us per mask\n", steps, bytes.size(),
              mask_us / steps);
}

// GPT-2's 50257 tokens, where most of a string's tokens take the shortcut (a plain token in a
// state every plain byte leads back to) and repeated states come from the mask cache: the mask
// still equals the matcher run over every token, at every step, with unbounded strings (the
// shortcut), a bounded one (the walk) and escapes, quotes and non-ASCII inside them.
// The brute force runs the matcher on every token of the 50k vocabulary at every step: 2 s in the
// release build, over two minutes under ASan. There it checks every 7th token, and every token
// the mask opened at a step that opened fewer than 5000 (inside a string most tokens are open,
// so sampling only the closed ones saved nothing); the release build checks them all.
#if defined(__SANITIZE_ADDRESS__)
constexpr size_t kBruteStride = 7;
#else
constexpr size_t kBruteStride = 1;
#endif

TEST(JsonSchemaConstraint, OnGpt2sVocabularyTheShortcutAndTheCacheEqualTheMatcher) {
  auto gguf = GgufFile::open(testing::repo_path("data/tokenizer-tests/ggml-vocab-gpt-2.gguf"));
  ASSERT_TRUE(gguf.is_ok()) << gguf.status().to_string();
  auto tok = load_gguf_tokenizer(**gguf);
  ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
  const auto vocabulary = VocabularyBytes::build(**tok);
  const auto& bytes = vocabulary->bytes;
  const char* schema =
      R"({"type":"object","properties":{"note":{"type":"string"},"tag":{"type":"string","maxLength":6},)"
      R"("list":{"type":"array","items":{"type":"string"}}},"required":["note","tag","list"],"additionalProperties":false})";
  const std::string doc =
      "{\"note\": \"She said, \\\"let's play!\\\" \u00e9t\u00e9 and ran\", \"tag\": \"a\\nb\", "
      "\"list\": [\"one two\", \"three\"]}";
  ASSERT_TRUE(json::parse(doc, nullptr, false).is_object()) << doc;
  auto ids = (*tok)->encode(doc, /*add_bos=*/false);
  ASSERT_TRUE(ids.is_ok());
  auto con = JsonSchemaConstraint::create(ordered_json::parse(schema), vocabulary);
  ASSERT_TRUE(con.is_ok()) << con.status().to_string();
  int steps = 0;
  for (TokenId id : *ids) {
    std::vector<float> logits(bytes.size(), 0.0f);
    ASSERT_TRUE((*con)->mask(logits).is_ok());
    int open = 0;
    const auto opened = std::count(logits.begin(), logits.end(), 0.0f);
    for (size_t t = 0; t < logits.size(); ++t) {
      if (t % kBruteStride != 0 && !(logits[t] == 0.0f && opened < 5000)) continue;
      const bool brute = !bytes[t].empty() && (*con)->matcher().accepts(bytes[t]);
      ASSERT_EQ(logits[t] == 0.0f, brute) << "step " << steps << ", token " << t << " '" << bytes[t] << "'";
      open += brute;
    }
    EXPECT_GT(open, 0);
    ASSERT_TRUE((*con)->accept(id).is_ok()) << "step " << steps << " token '" << bytes[id] << "'";
    ++steps;
  }
  EXPECT_TRUE((*con)->closed());
  EXPECT_GT(steps, 20);
}

TEST(JsonSchemaConstraint, Stories260KWritesValidDocumentsThroughTheScheduler) {
  const Stories st = load_stories();
  auto engine = testing::stories_engine(4);
  const char* schema_text =
      R"({"type":"object","properties":{"name":{"type":"string","maxLength":12},"age":{"type":"integer"}},
          "required":["name","age"],"additionalProperties":false})";
  const json schema = json::parse(schema_text);
  auto prototype = JsonSchemaConstraint::create(ordered_json::parse(schema_text), st.vocabulary);
  ASSERT_TRUE(prototype.is_ok()) << prototype.status().to_string();
  const std::shared_ptr<const TokenConstraint> shared = std::move(*prototype);
  Scheduler s(*engine, GeneratorOptions{});
  auto prompt = st.tok->encode("Once upon a time", true);
  ASSERT_TRUE(prompt.is_ok());
  const std::vector<float> temperatures = {0.0f, 0.8f, 1.0f, 1.3f};
  std::vector<RequestId> ids;
  for (size_t i = 0; i < temperatures.size(); ++i) {
    GenerationRequest r;
    r.prompt = *prompt;
    r.max_new_tokens = 120;  // the grammar closes within 12 + 16 characters of values
    r.sampling.temperature = temperatures[i];
    r.sampling.seed = 3 + i;
    r.stop_ids = st.tok->stop_ids();
    r.constraint = shared;
    auto id = s.submit(r);
    ASSERT_TRUE(id.is_ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  std::map<int64_t, std::vector<TokenId>> tokens;
  std::map<int64_t, FinishReason> finish;
  std::vector<SchedulerEvent> ev;
  for (int i = 0; i < 1000 && !s.idle(); ++i) {
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    for (const SchedulerEvent& e : ev) {
      if (e.finished) {
        finish[e.request.value()] = e.finish;
        EXPECT_TRUE(e.error.empty()) << e.error;
      } else {
        tokens[e.request.value()].push_back(e.token);
      }
    }
  }
  ASSERT_TRUE(s.idle());
  std::set<std::string> texts;
  for (const RequestId& id : ids) {
    std::string text;
    TokenId prev = prompt->back();
    for (TokenId t : tokens[id.value()]) {
      text += st.tok->decode_token(prev, t);
      prev = t;
    }
    SCOPED_TRACE(text);
    EXPECT_EQ(finish[id.value()], FinishReason::kStop);
    EXPECT_TRUE(text_valid(text, schema));
    texts.insert(text);
    std::printf("[ output   ] %s\n", text.c_str());
  }
  EXPECT_GE(texts.size(), 2u);  // sampling makes a difference
}

}  // namespace
}  // namespace specontext
