#include "serving/structured/json_schema.h"

#include <algorithm>
#include <limits>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>
#include <utility>

#include "core/base/json_depth.h"

namespace specontext {

namespace {

using Json = nlohmann::ordered_json;
using E = GrammarElement;
using Seq = GrammarSequence;

constexpr int kMaxSchemaDepth = 64;
constexpr size_t kMaxRules = 200000;

Status schema_error(const std::string& message) {
  return invalid_argument("JSON schema: " + message);
}

std::string at(const std::string& ptr) { return ptr.empty() ? "the root" : ptr; }

std::string child(const std::string& ptr, std::string_view key) {
  std::string out = ptr + "/";
  for (char c : key) {
    if (c == '~') {
      out += "~0";
    } else if (c == '/') {
      out += "~1";
    } else {
      out += c;
    }
  }
  return out;
}

// The compact serialisation; never throws (invalid UTF-8 in a string is replaced).
std::string dump(const Json& v) { return v.dump(-1, ' ', false, Json::error_handler_t::replace); }

bool is_descriptive(std::string_view k) {
  for (std::string_view d : {"title", "description", "$schema", "$id", "$anchor", "examples", "default",
                             "$comment", "deprecated", "readOnly", "writeOnly", "$defs", "definitions"}) {
    if (k == d) return true;
  }
  return false;
}

bool is_supported(std::string_view k) {
  for (std::string_view d :
       {"type", "enum", "const", "properties", "required", "additionalProperties", "items", "prefixItems",
        "minItems", "maxItems", "minLength", "maxLength", "anyOf", "oneOf", "allOf", "$ref"}) {
    if (k == d) return true;
  }
  return false;
}

std::bitset<256> plain_bytes() {  // a string's characters that need no escape, ASCII
  std::bitset<256> s;
  for (int b = 0x20; b < 0x80; ++b) s.set(static_cast<size_t>(b));
  s.reset('"');
  s.reset('\\');
  return s;
}

std::bitset<256> bytes_of(std::string_view chars) {
  std::bitset<256> s;
  for (char c : chars) s.set(static_cast<uint8_t>(c));
  return s;
}

class SchemaCompiler {
 public:
  explicit SchemaCompiler(const Json& root) : root_(root) {}

  Result<Grammar> run() {
    const uint32_t top = b_.declare("root");
    refs_["#"] = top;
    SPX_ASSIGN_OR_RETURN(const uint32_t body, compile(root_, "", 0));
    b_.define(top, {{E::ref(body)}});
    auto g = b_.build(top);
    if (!g.is_ok()) return schema_error(g.status().message());
    return std::move(g).value();
  }

 private:
  // --- shared rules, built on first use ---
  uint32_t ws() {
    if (!ws_) ws_ = b_.add("ws", {{E::byte(' ')}, {}});
    return *ws_;
  }
  uint32_t hex4(const std::string& name, const E& first, const E& second) {
    const E hex = E::set(bytes_of("0123456789abcdefABCDEF"));
    return b_.add(name, {{first, second, hex, hex}});
  }
  uint32_t utf8() {  // one multi-byte character, RFC 3629 (no overlong forms, no surrogates)
    if (utf8_) return *utf8_;
    const E cont = E::range(0x80, 0xBF);
    utf8_ = b_.add("utf8", {
                               {E::range(0xC2, 0xDF), cont},
                               {E::byte(0xE0), E::range(0xA0, 0xBF), cont},
                               {E::set(E::range(0xE1, 0xEC).bytes | E::range(0xEE, 0xEF).bytes), cont, cont},
                               {E::byte(0xED), E::range(0x80, 0x9F), cont},
                               {E::byte(0xF0), E::range(0x90, 0xBF), cont, cont},
                               {E::range(0xF1, 0xF3), cont, cont, cont},
                               {E::byte(0xF4), E::range(0x80, 0x8F), cont, cont},
                           });
    return *utf8_;
  }
  uint32_t escape() {  // \X or \uXXXX, surrogates only as high-low pairs
    if (escape_) return *escape_;
    const E hex = E::set(bytes_of("0123456789abcdefABCDEF"));
    const uint32_t single = b_.add("u-bmp", {{E::set(bytes_of("0123456789ABCabc")), hex, hex, hex},
                                             {E::set(bytes_of("Dd")), E::range('0', '7'), hex, hex},
                                             {E::set(bytes_of("EFef")), hex, hex, hex}});
    const uint32_t high = hex4("u-high", E::set(bytes_of("Dd")), E::set(bytes_of("89ABab")));
    const uint32_t low = hex4("u-low", E::set(bytes_of("Dd")), E::set(bytes_of("CDEFcdef")));
    escape_ = b_.add("escape",
                     {{E::byte('\\'), E::set(bytes_of("\"\\/bfnrt"))},
                      {E::byte('\\'), E::byte('u'), E::ref(single)},
                      {E::byte('\\'), E::byte('u'), E::ref(high), E::byte('\\'), E::byte('u'), E::ref(low)}});
    return *escape_;
  }
  uint32_t character() {
    if (!char_) char_ = b_.add("char", {{E::set(plain_bytes())}, {E::ref(escape())}, {E::ref(utf8())}});
    return *char_;
  }
  uint32_t string_tail() {  // characters, then the closing quote
    if (!string_tail_) {
      const uint32_t chars = b_.star({E::ref(character())}, "chars");
      string_tail_ = b_.add("string-tail", {{E::ref(chars), E::byte('"')}});
    }
    return *string_tail_;
  }
  uint32_t string() {
    if (!string_) string_ = b_.add("string", {{E::byte('"'), E::ref(string_tail())}});
    return *string_;
  }
  Result<uint32_t> digits(uint32_t min, uint32_t max, const std::string& name) {
    return b_.repeat({E::range('0', '9')}, min, max, name);
  }
  Result<uint32_t> integer() {
    if (integer_) return *integer_;
    SPX_ASSIGN_OR_RETURN(const uint32_t more, digits(0, 15, "int-digits"));
    const uint32_t mag = b_.add("int-magnitude", {{E::byte('0')}, {E::range('1', '9'), E::ref(more)}});
    integer_ = b_.add("integer", {{E::byte('-'), E::ref(mag)}, {E::ref(mag)}});
    return *integer_;
  }
  Result<uint32_t> number() {
    if (number_) return *number_;
    SPX_ASSIGN_OR_RETURN(const uint32_t whole, integer());
    SPX_ASSIGN_OR_RETURN(const uint32_t frac_digits, digits(1, 16, "frac-digits"));
    SPX_ASSIGN_OR_RETURN(const uint32_t exp_digits, digits(1, 2, "exp-digits"));
    const uint32_t frac = b_.add("frac", {{E::byte('.'), E::ref(frac_digits)}, {}});
    const uint32_t exp = b_.add("exp", {{E::set(bytes_of("eE")), E::set(bytes_of("+-")), E::ref(exp_digits)},
                                        {E::set(bytes_of("eE")), E::ref(exp_digits)},
                                        {}});
    number_ = b_.add("number", {{E::ref(whole), E::ref(frac), E::ref(exp)}});
    return *number_;
  }
  Result<uint32_t> value() {  // any JSON value
    if (value_) return *value_;
    const uint32_t v = b_.declare("value");
    value_ = v;
    SPX_ASSIGN_OR_RETURN(const uint32_t num, number());
    const uint32_t member = b_.add("member", {{E::ref(string()), E::byte(':'), E::ref(ws()), E::ref(v)}});
    const uint32_t members = b_.star({E::byte(','), E::ref(ws()), E::ref(member)}, "members");
    const uint32_t object = b_.add("object", {{E::byte('{'), E::byte('}')},
                                              {E::byte('{'), E::ref(member), E::ref(members), E::byte('}')}});
    const uint32_t items = b_.star({E::byte(','), E::ref(ws()), E::ref(v)}, "elements");
    const uint32_t array = b_.add(
        "array", {{E::byte('['), E::byte(']')}, {E::byte('['), E::ref(v), E::ref(items), E::byte(']')}});
    b_.define(v, {{E::ref(object)},
                  {E::ref(array)},
                  {E::ref(string())},
                  {E::ref(num)},
                  GrammarBuilder::literal("true"),
                  GrammarBuilder::literal("false"),
                  GrammarBuilder::literal("null")});
    return v;
  }

  // --- keyword readers ---
  static Result<std::optional<uint32_t>> count(const Json& s, const char* key, const std::string& ptr) {
    auto it = s.find(key);
    if (it == s.end()) return std::optional<uint32_t>();
    // A built document holds 1 as a signed integer; parsed text holds it as unsigned.
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      return schema_error("'" + std::string(key) + "' at " + at(ptr) + " must be a non-negative integer");
    }
    const uint64_t v = it->get<uint64_t>();
    if (v > GrammarBuilder::kMaxRepeat) {
      return schema_error("'" + std::string(key) + "' at " + at(ptr) + " above " +
                          std::to_string(GrammarBuilder::kMaxRepeat) + " is not supported");
    }
    return std::optional<uint32_t>(static_cast<uint32_t>(v));
  }

  Result<uint32_t> compile(const Json& s, const std::string& ptr, int depth) {
    if (depth > kMaxSchemaDepth) {
      return schema_error("the schema nests deeper than " + std::to_string(kMaxSchemaDepth) + " at " +
                          at(ptr));
    }
    if (b_.rule_count() > kMaxRules) return schema_error("the schema is too large (at " + at(ptr) + ")");
    if (s.is_boolean()) {
      if (s.get<bool>()) return value();
      return schema_error("no value can match the schema false at " + at(ptr));
    }
    if (!s.is_object()) return schema_error("the schema at " + at(ptr) + " must be an object or a boolean");
    std::vector<std::string> restricting;
    for (auto it = s.begin(); it != s.end(); ++it) {
      if (is_descriptive(it.key())) continue;
      if (!is_supported(it.key())) {
        return schema_error("unsupported keyword '" + it.key() + "' at " + at(ptr));
      }
      restricting.push_back(it.key());
    }
    for (std::string_view combinator : {"$ref", "anyOf", "oneOf", "allOf"}) {
      if (!s.contains(combinator)) continue;
      for (const std::string& k : restricting) {
        if (k != combinator) {
          return schema_error("'" + std::string(combinator) + "' beside '" + k + "' at " + at(ptr) +
                              " is not supported");
        }
      }
      if (combinator == "$ref") return reference(s["$ref"], ptr, depth);
      return combination(s[std::string(combinator)], std::string(combinator), child(ptr, combinator), depth);
    }
    if (s.contains("enum") || s.contains("const")) return enumeration(s, restricting, ptr);
    // The kinds of value allowed: `type`, else the kinds the keywords imply, else any value.
    std::set<std::string> types;
    if (auto it = s.find("type"); it != s.end()) {
      std::vector<std::string> names;
      if (it->is_string()) {
        names.push_back(it->get<std::string>());
      } else if (it->is_array()) {
        for (const Json& t : *it) {
          if (!t.is_string())
            return schema_error("'type' at " + at(ptr) + " must be a string or an array of strings");
          names.push_back(t.get<std::string>());
        }
      } else {
        return schema_error("'type' at " + at(ptr) + " must be a string or an array of strings");
      }
      for (const std::string& t : names) {
        if (t != "object" && t != "array" && t != "string" && t != "number" && t != "integer" &&
            t != "boolean" && t != "null") {
          return schema_error("unknown type '" + t + "' at " + at(ptr));
        }
        types.insert(t);
      }
      if (types.empty()) return schema_error("no value can match an empty 'type' at " + at(ptr));
    } else {
      for (const std::string& k : restricting) {
        if (k == "properties" || k == "required" || k == "additionalProperties") types.insert("object");
        if (k == "items" || k == "prefixItems" || k == "minItems" || k == "maxItems") types.insert("array");
        if (k == "minLength" || k == "maxLength") types.insert("string");
      }
      if (types.empty()) return value();
    }
    if (types.count("number") != 0) types.erase("integer");  // integers are numbers
    std::vector<Seq> alternatives;
    for (const std::string& t : types) {
      uint32_t r = 0;
      if (t == "object") {
        SPX_ASSIGN_OR_RETURN(r, object(s, ptr, depth));
      } else if (t == "array") {
        SPX_ASSIGN_OR_RETURN(r, array(s, ptr, depth));
      } else if (t == "string") {
        SPX_ASSIGN_OR_RETURN(r, bounded_string(s, ptr));
      } else if (t == "integer") {
        SPX_ASSIGN_OR_RETURN(r, integer());
      } else if (t == "number") {
        SPX_ASSIGN_OR_RETURN(r, number());
      } else if (t == "boolean") {
        r = b_.add(ptr + ":boolean", {GrammarBuilder::literal("true"), GrammarBuilder::literal("false")});
      } else {
        r = b_.add(ptr + ":null", {GrammarBuilder::literal("null")});
      }
      alternatives.push_back({E::ref(r)});
    }
    if (alternatives.size() == 1) return alternatives[0][0].rule;
    return b_.add(ptr + ":types", std::move(alternatives));
  }

  Result<uint32_t> reference(const Json& ref, const std::string& ptr, int depth) {
    if (!ref.is_string()) return schema_error("'$ref' at " + at(ptr) + " must be a string");
    const std::string r = ref.get<std::string>();
    if (auto it = refs_.find(r); it != refs_.end()) return it->second;
    std::string section, name;
    for (std::string_view prefix : {"#/$defs/", "#/definitions/"}) {
      if (r.size() > prefix.size() && r.compare(0, prefix.size(), prefix) == 0) {
        section = std::string(prefix.substr(2, prefix.size() - 3));
        name = r.substr(prefix.size());
      }
    }
    if (section.empty() || name.find('/') != std::string::npos) {
      return schema_error("unsupported $ref '" + r + "' at " + at(ptr) +
                          " (only \"#\", \"#/$defs/NAME\" and \"#/definitions/NAME\")");
    }
    std::string decoded;  // JSON pointer escapes
    for (size_t i = 0; i < name.size(); ++i) {
      if (name[i] == '~' && i + 1 < name.size() && (name[i + 1] == '0' || name[i + 1] == '1')) {
        decoded += name[i + 1] == '0' ? '~' : '/';
        ++i;
      } else {
        decoded += name[i];
      }
    }
    const auto sec = root_.is_object() ? root_.find(section) : root_.end();
    if (!root_.is_object() || sec == root_.end() || !sec->is_object() || !sec->contains(decoded)) {
      return schema_error("$ref '" + r + "' at " + at(ptr) + " names no definition");
    }
    const std::string target = child(child("", section), decoded);
    const uint32_t rule = b_.declare(target);
    refs_[r] = rule;
    SPX_ASSIGN_OR_RETURN(const uint32_t body, compile((*sec)[decoded], target, depth + 1));
    b_.define(rule, {{E::ref(body)}});
    return rule;
  }

  Result<uint32_t> combination(const Json& list, const std::string& keyword, const std::string& ptr,
                               int depth) {
    if (!list.is_array() || list.empty()) {
      return schema_error("'" + keyword + "' at " + at(ptr) + " must be a non-empty array");
    }
    if (keyword == "allOf" && list.size() != 1) {
      return schema_error("'allOf' of more than one schema at " + at(ptr) + " is not supported");
    }
    std::vector<Seq> alternatives;
    for (size_t i = 0; i < list.size(); ++i) {
      if (list[i].is_boolean() && !list[i].get<bool>() && keyword != "allOf") continue;  // matches nothing
      SPX_ASSIGN_OR_RETURN(const uint32_t r, compile(list[i], child(ptr, std::to_string(i)), depth + 1));
      alternatives.push_back({E::ref(r)});
    }
    if (alternatives.empty()) return schema_error("no value can match '" + keyword + "' at " + at(ptr));
    return b_.add(ptr, std::move(alternatives));
  }

  static bool has_type(const Json& v, const std::string& t) {
    if (t == "object") return v.is_object();
    if (t == "array") return v.is_array();
    if (t == "string") return v.is_string();
    if (t == "integer") return v.is_number_integer();
    if (t == "number") return v.is_number();
    if (t == "boolean") return v.is_boolean();
    return t == "null" && v.is_null();
  }

  Result<uint32_t> enumeration(const Json& s, const std::vector<std::string>& restricting,
                               const std::string& ptr) {
    const bool is_enum = s.contains("enum");
    for (const std::string& k : restricting) {
      if (k != "type" && k != (is_enum ? "enum" : "const")) {
        return schema_error("'" + std::string(is_enum ? "enum" : "const") + "' beside '" + k + "' at " +
                            at(ptr) + " is not supported");
      }
    }
    std::vector<Json> values;
    if (is_enum) {
      const Json& e = s["enum"];
      if (!e.is_array() || e.empty())
        return schema_error("'enum' at " + at(ptr) + " must be a non-empty array");
      values.assign(e.begin(), e.end());
    } else {
      values.push_back(s["const"]);
    }
    std::vector<std::string> types;
    if (auto it = s.find("type"); it != s.end()) {
      if (it->is_string()) {
        types.push_back(it->get<std::string>());
      } else if (it->is_array()) {
        for (const Json& t : *it) {
          if (!t.is_string())
            return schema_error("'type' at " + at(ptr) + " must be a string or an array of strings");
          types.push_back(t.get<std::string>());
        }
      } else {
        return schema_error("'type' at " + at(ptr) + " must be a string or an array of strings");
      }
    }
    std::vector<Seq> alternatives;
    std::set<std::string> seen;
    for (const Json& v : values) {
      if (!types.empty() &&
          std::none_of(types.begin(), types.end(), [&](const std::string& t) { return has_type(v, t); })) {
        continue;
      }
      const std::string text = dump(v);
      if (seen.insert(text).second) alternatives.push_back(GrammarBuilder::literal(text));
    }
    if (alternatives.empty()) return schema_error("no value of 'type' is in the enum at " + at(ptr));
    if (alternatives.size() > kMaxEnumValues) {
      return schema_error("'enum' at " + at(ptr) + " has " + std::to_string(alternatives.size()) +
                          " values; at most " + std::to_string(kMaxEnumValues) + " are supported");
    }
    return b_.add(ptr + ":enum", std::move(alternatives));
  }

  Result<uint32_t> bounded_string(const Json& s, const std::string& ptr) {
    SPX_ASSIGN_OR_RETURN(const std::optional<uint32_t> min, count(s, "minLength", ptr));
    SPX_ASSIGN_OR_RETURN(const std::optional<uint32_t> max, count(s, "maxLength", ptr));
    if (!min && !max) return string();
    if (min && max && *min > *max) {
      return schema_error("no string can match minLength > maxLength at " + at(ptr));
    }
    SPX_ASSIGN_OR_RETURN(const uint32_t chars,
                         b_.repeat({E::ref(character())}, min.value_or(0), max, ptr + ":chars"));
    return b_.add(ptr + ":string", {{E::byte('"'), E::ref(chars), E::byte('"')}});
  }

  // A key that is none of `declared`: while its bytes spell a declared key's prefix it follows a
  // trie of those keys, and it may end only where no declared key ends.
  Result<uint32_t> extra_key(const std::vector<std::string>& declared, const std::string& ptr) {
    if (declared.empty()) return string();
    const std::bitset<256> plain = plain_bytes();
    struct Node {
      std::map<uint8_t, size_t> children;
      bool terminal = false;
    };
    std::vector<Node> nodes(1);
    for (const std::string& key : declared) {
      for (unsigned char c : key) {
        if (!plain.test(c)) {
          return schema_error(
              "additional properties beside a property name holding characters other than "
              "printable ASCII at " +
              at(ptr) + " are not supported");
        }
      }
      size_t n = 0;
      for (unsigned char c : key) {
        auto it = nodes[n].children.find(c);
        if (it == nodes[n].children.end()) {
          nodes.emplace_back();
          it = nodes[n].children.emplace(c, nodes.size() - 1).first;
        }
        n = it->second;
      }
      nodes[n].terminal = true;
    }
    const uint32_t tail = string_tail();
    const uint32_t other_escape =
        b_.add(ptr + ":key-escape", {{E::byte('\\'), E::set(bytes_of("\"\\bfnrt"))}});
    std::vector<uint32_t> rules(nodes.size());
    for (size_t i = nodes.size(); i-- > 0;) {  // children were added after their parents
      std::vector<Seq> alternatives;
      if (!nodes[i].terminal) alternatives.push_back({E::byte('"')});
      std::bitset<256> others = plain;
      for (const auto& [c, n] : nodes[i].children) {
        alternatives.push_back({E::byte(c), E::ref(rules[n])});
        others.reset(c);
      }
      if (others.any()) alternatives.push_back({E::set(others), E::ref(tail)});
      alternatives.push_back({E::ref(other_escape), E::ref(tail)});
      alternatives.push_back({E::ref(utf8()), E::ref(tail)});
      rules[i] = b_.add(ptr + ":key" + std::to_string(i), std::move(alternatives));
    }
    return b_.add(ptr + ":extra-key", {{E::byte('"'), E::ref(rules[0])}});
  }

  Result<uint32_t> object(const Json& s, const std::string& ptr, int depth) {
    struct Property {
      std::string key;
      uint32_t value = 0;
      bool required = false;
    };
    std::vector<std::string> required;
    if (auto it = s.find("required"); it != s.end()) {
      if (!it->is_array()) return schema_error("'required' at " + at(ptr) + " must be an array of strings");
      for (const Json& k : *it) {
        if (!k.is_string()) return schema_error("'required' at " + at(ptr) + " must be an array of strings");
        if (std::find(required.begin(), required.end(), k.get<std::string>()) == required.end()) {
          required.push_back(k.get<std::string>());
        }
      }
    }
    const auto props = s.find("properties");
    if (props != s.end() && !props->is_object()) {
      return schema_error("'properties' at " + at(ptr) + " must be an object");
    }
    // Extra keys: additionalProperties true or a schema; absent only when nothing is declared.
    std::optional<uint32_t> extra;
    if (auto it = s.find("additionalProperties"); it != s.end()) {
      if (it->is_object() || (it->is_boolean() && it->get<bool>())) {
        SPX_ASSIGN_OR_RETURN(extra, compile(*it, child(ptr, "additionalProperties"), depth + 1));
      } else if (!it->is_boolean()) {
        return schema_error("'additionalProperties' at " + at(ptr) + " must be a boolean or a schema");
      }
    } else if (props == s.end() && required.empty()) {
      SPX_ASSIGN_OR_RETURN(extra, value());
    }
    std::vector<Property> declared;
    if (props != s.end()) {
      for (auto it = props->begin(); it != props->end(); ++it) {
        const bool req = std::find(required.begin(), required.end(), it.key()) != required.end();
        if (it->is_boolean() && !it->get<bool>()) {
          if (req) {
            return schema_error("no value can match required property '" + it.key() + "' at " +
                                at(child(child(ptr, "properties"), it.key())));
          }
          continue;  // may not appear
        }
        SPX_ASSIGN_OR_RETURN(const uint32_t v,
                             compile(*it, child(child(ptr, "properties"), it.key()), depth + 1));
        declared.push_back(Property{it.key(), v, req});
      }
    }
    for (const std::string& k : required) {
      if (props != s.end() && props->contains(k)) continue;
      if (!extra) {
        return schema_error("required property '" + k + "' at " + at(ptr) +
                            " is not in 'properties' and additionalProperties is false or absent");
      }
      declared.push_back(Property{k, *extra, true});
    }
    std::optional<uint32_t> extra_member;
    std::vector<std::string> names;
    for (const Property& p : declared)
      names.push_back(dump(Json(p.key)).substr(1, dump(Json(p.key)).size() - 2));
    if (extra) {
      SPX_ASSIGN_OR_RETURN(const uint32_t key, extra_key(names, ptr));
      extra_member = b_.add(ptr + ":extra", {{E::ref(key), E::byte(':'), E::ref(ws()), E::ref(*extra)}});
    }
    // rest_i: at least one member written, property i next (each needs a comma first);
    // first_i: none written yet, property i next. Optional properties may be skipped.
    const size_t n = declared.size();
    std::vector<uint32_t> rest(n + 1), first(n + 1);
    if (extra_member) {
      const uint32_t more = b_.star({E::byte(','), E::ref(ws()), E::ref(*extra_member)}, ptr + ":extras");
      rest[n] = more;
      first[n] = b_.add(ptr + ":first-extra", {{E::ref(*extra_member), E::ref(more)}, {}});
    } else {
      rest[n] = first[n] = b_.add(ptr + ":end", {{}});
    }
    for (size_t i = n; i-- > 0;) {
      const Property& p = declared[i];
      Seq member = GrammarBuilder::literal("\"" + names[i] + "\":");
      member.push_back(E::ref(ws()));
      member.push_back(E::ref(p.value));
      const uint32_t m = b_.add(child(child(ptr, "properties"), p.key) + ":member", {member});
      std::vector<Seq> r{{E::byte(','), E::ref(ws()), E::ref(m), E::ref(rest[i + 1])}};
      std::vector<Seq> f{{E::ref(m), E::ref(rest[i + 1])}};
      if (!p.required) {
        r.push_back({E::ref(rest[i + 1])});
        f.push_back({E::ref(first[i + 1])});
      }
      rest[i] = b_.add(ptr + ":rest" + std::to_string(i), std::move(r));
      first[i] = b_.add(ptr + ":first" + std::to_string(i), std::move(f));
    }
    return b_.add(ptr + ":object", {{E::byte('{'), E::ref(first[0]), E::byte('}')}});
  }

  Result<uint32_t> array(const Json& s, const std::string& ptr, int depth) {
    std::vector<uint32_t> prefix;
    if (auto it = s.find("prefixItems"); it != s.end()) {
      if (!it->is_array())
        return schema_error("'prefixItems' at " + at(ptr) + " must be an array of schemas");
      for (size_t i = 0; i < it->size(); ++i) {
        SPX_ASSIGN_OR_RETURN(
            const uint32_t r,
            compile((*it)[i], child(child(ptr, "prefixItems"), std::to_string(i)), depth + 1));
        prefix.push_back(r);
      }
    }
    std::optional<uint32_t> items;  // none (items false): no item beyond the prefix
    if (auto it = s.find("items"); it != s.end()) {
      if (it->is_array()) {
        return schema_error("'items' as an array at " + at(ptr) + " is not supported (use prefixItems)");
      }
      if (!it->is_boolean() || it->get<bool>()) {
        SPX_ASSIGN_OR_RETURN(items, compile(*it, child(ptr, "items"), depth + 1));
      }
    } else {
      SPX_ASSIGN_OR_RETURN(items, value());
    }
    SPX_ASSIGN_OR_RETURN(const std::optional<uint32_t> min_items, count(s, "minItems", ptr));
    SPX_ASSIGN_OR_RETURN(std::optional<uint32_t> max_items, count(s, "maxItems", ptr));
    const uint32_t lo = min_items.value_or(0);
    const uint32_t k = static_cast<uint32_t>(prefix.size());
    if (!items && (!max_items || *max_items > k)) max_items = k;
    if (max_items && lo > *max_items) return schema_error("no array can match minItems at " + at(ptr));
    if (prefix.size() > GrammarBuilder::kMaxRepeat) return schema_error("too many prefixItems at " + at(ptr));
    // after[j]: what follows j written items (j >= 1).
    const uint32_t hi = max_items.value_or(std::numeric_limits<uint32_t>::max());
    const auto item_at = [&](uint32_t j) { return j < k ? prefix[j] : *items; };
    const uint32_t tail_from =
        std::max<uint32_t>(1, std::min(k, hi));  // after[j] for j >= this is a repetition
    std::vector<uint32_t> after(tail_from + 1);
    {
      const uint32_t j = tail_from;
      if (j >= hi || !items) {
        after[j] = b_.add(ptr + ":items-end", {{}});
      } else {
        std::optional<uint32_t> more_max;
        if (max_items) more_max = *max_items - j;
        SPX_ASSIGN_OR_RETURN(after[j], b_.repeat({E::byte(','), E::ref(ws()), E::ref(*items)},
                                                 lo > j ? lo - j : 0, more_max, ptr + ":items"));
      }
    }
    for (uint32_t j = tail_from; j-- > 1;) {
      std::vector<Seq> alternatives{{E::byte(','), E::ref(ws()), E::ref(item_at(j)), E::ref(after[j + 1])}};
      if (j >= lo) alternatives.push_back({});
      after[j] = b_.add(ptr + ":after" + std::to_string(j), std::move(alternatives));
    }
    std::vector<Seq> alternatives;
    if (lo == 0) alternatives.push_back({E::byte('['), E::byte(']')});
    if (hi >= 1) alternatives.push_back({E::byte('['), E::ref(item_at(0)), E::ref(after[1]), E::byte(']')});
    return b_.add(ptr + ":array", std::move(alternatives));
  }

  GrammarBuilder b_;
  const Json& root_;
  std::map<std::string, uint32_t> refs_;
  std::optional<uint32_t> ws_, utf8_, escape_, char_, string_tail_, string_, integer_, number_, value_;
};

Status too_deep_error() {
  return schema_error("the schema nests arrays and objects deeper than " + std::to_string(kMaxJsonDepth) +
                      " levels");
}

}  // namespace

Result<Grammar> json_schema_to_grammar(const nlohmann::ordered_json& schema) {
  // Before anything recurses over the tree (the compiler, dumps of enum and const values).
  if (json_deeper_than(schema, kMaxJsonDepth)) return too_deep_error();
  return SchemaCompiler(schema).run();
}

Result<Grammar> json_schema_to_grammar(const nlohmann::json& schema) {
  if (json_deeper_than(schema, kMaxJsonDepth)) return too_deep_error();
  // Same keys, sorted (nlohmann::json does not keep the order).
  Json ordered;
  try {
    ordered = Json::parse(schema.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
  } catch (const std::exception& e) {
    return schema_error(std::string("cannot read the schema: ") + e.what());
  }
  return json_schema_to_grammar(ordered);
}

std::shared_ptr<const VocabularyTrie> VocabularyTrie::build(const VocabularyBytes& vocabulary) {
  auto trie = std::make_shared<VocabularyTrie>();
  const std::vector<std::string>& bytes = vocabulary.bytes;
  std::vector<TokenId> ids;
  for (size_t i = 0; i < bytes.size(); ++i) {
    if (!bytes[i].empty()) ids.push_back(static_cast<TokenId>(i));
  }
  // Sorted, a node's tokens are one run: those ending at it first, then its children's runs.
  std::stable_sort(ids.begin(), ids.end(), [&](TokenId a, TokenId b) {
    return bytes[static_cast<size_t>(a)] < bytes[static_cast<size_t>(b)];
  });
  trie->nodes.resize(1);
  struct Pending {
    uint32_t node;
    size_t lo, hi, depth;
  };
  std::vector<Pending> todo{{0, 0, ids.size(), 0}};
  while (!todo.empty()) {
    const Pending p = todo.back();
    todo.pop_back();
    const auto piece = [&](size_t i) -> const std::string& { return bytes[static_cast<size_t>(ids[i])]; };
    size_t i = p.lo;
    trie->nodes[p.node].tokens_begin = static_cast<uint32_t>(trie->tokens.size());
    while (i < p.hi && piece(i).size() == p.depth) trie->tokens.push_back(ids[i++]);
    trie->nodes[p.node].tokens_end = static_cast<uint32_t>(trie->tokens.size());
    trie->max_depth = std::max(trie->max_depth, p.depth);
    trie->nodes[p.node].children_begin = static_cast<uint32_t>(trie->nodes.size());
    while (i < p.hi) {
      const char c = piece(i)[p.depth];
      size_t j = i;
      while (j < p.hi && piece(j)[p.depth] == c) ++j;
      Node child;
      child.byte = static_cast<uint8_t>(c);
      trie->nodes.push_back(child);
      todo.push_back({static_cast<uint32_t>(trie->nodes.size() - 1), i, j, p.depth + 1});
      i = j;
    }
    trie->nodes[p.node].children_end = static_cast<uint32_t>(trie->nodes.size());
  }
  return trie;
}

std::shared_ptr<const VocabularyTrie> VocabularyTrie::of(
    const std::shared_ptr<const VocabularyBytes>& vocabulary) {
  static std::mutex mu;
  static std::vector<std::pair<std::weak_ptr<const VocabularyBytes>, std::shared_ptr<const VocabularyTrie>>>
      cache;
  std::lock_guard<std::mutex> lock(mu);
  std::erase_if(cache, [](const auto& e) { return e.first.expired(); });
  for (const auto& [owner, trie] : cache) {
    if (!owner.owner_before(vocabulary) && !vocabulary.owner_before(owner)) return trie;
  }
  auto trie = build(*vocabulary);
  cache.emplace_back(vocabulary, trie);
  return trie;
}

Result<std::unique_ptr<JsonSchemaConstraint>> JsonSchemaConstraint::create(
    std::shared_ptr<const Grammar> grammar, std::shared_ptr<const VocabularyBytes> vocabulary) {
  if (vocabulary == nullptr) return invalid_argument("JSON schema: no vocabulary");
  SPX_ASSIGN_OR_RETURN(GrammarMatcher matcher, GrammarMatcher::create(std::move(grammar)));
  auto trie = VocabularyTrie::of(vocabulary);
  return std::unique_ptr<JsonSchemaConstraint>(
      new JsonSchemaConstraint(std::move(vocabulary), std::move(trie), std::move(matcher)));
}

Result<std::unique_ptr<JsonSchemaConstraint>> JsonSchemaConstraint::create(
    const nlohmann::ordered_json& schema, std::shared_ptr<const VocabularyBytes> vocabulary) {
  if (vocabulary == nullptr) return invalid_argument("JSON schema: no vocabulary");
  SPX_ASSIGN_OR_RETURN(Grammar g, json_schema_to_grammar(schema));
  return create(std::make_shared<const Grammar>(std::move(g)), std::move(vocabulary));
}

Result<std::unique_ptr<JsonSchemaConstraint>> JsonSchemaConstraint::create(
    const nlohmann::json& schema, std::shared_ptr<const VocabularyBytes> vocabulary) {
  if (vocabulary == nullptr) return invalid_argument("JSON schema: no vocabulary");
  SPX_ASSIGN_OR_RETURN(Grammar g, json_schema_to_grammar(schema));
  return create(std::make_shared<const Grammar>(std::move(g)), std::move(vocabulary));
}

namespace {

// Depth-first over the trie, each node's matcher advanced once from its parent's, so a prefix
// shared by many tokens is matched once; subtrees whose first byte no stack takes are skipped.
struct TrieWalk {
  const VocabularyTrie& trie;
  std::vector<GrammarMatcher>& scratch;  // one per depth
  std::vector<uint8_t>& open;
  bool exhausted = false;
  void walk(uint32_t node, const GrammarMatcher& m, size_t depth) {
    const std::bitset<256> next = m.next_bytes();
    const VocabularyTrie::Node& n = trie.nodes[node];
    for (uint32_t c = n.children_begin; c < n.children_end; ++c) {
      const VocabularyTrie::Node& ch = trie.nodes[c];
      if (!next.test(ch.byte)) continue;
      GrammarMatcher& out = scratch[depth];
      const GrammarMatcher::Step s = m.advance_to(ch.byte, out);
      if (s == GrammarMatcher::Step::kExhausted) exhausted = true;
      if (s != GrammarMatcher::Step::kOk) continue;
      for (uint32_t t = ch.tokens_begin; t < ch.tokens_end; ++t)
        open[static_cast<size_t>(trie.tokens[t])] = 1;
      if (ch.children_end > ch.children_begin) walk(c, out, depth + 1);
    }
  }
};


bool is_plain(uint8_t b) { return b >= 0x20 && b <= 0x7E && b != '"' && b != '\\'; }

// Advances `from` over `bytes` through the scratch matchers a / b; the result is in a.
GrammarMatcher::Step advance_over(const GrammarMatcher& from, std::string_view bytes, GrammarMatcher& a,
                                  GrammarMatcher& b) {
  const GrammarMatcher* at = &from;
  for (char ch : bytes) {
    const GrammarMatcher::Step s = at->advance_to(static_cast<uint8_t>(ch), b);
    if (s != GrammarMatcher::Step::kOk) return s;
    std::swap(a, b);
    at = &a;
  }
  if (at == &from) a = from;
  return GrammarMatcher::Step::kOk;
}

}  // namespace

bool JsonSchemaConstraint::compute_open(std::vector<uint8_t>& open) const {
  // Inside a string without length bounds, every plain byte (printable ASCII but '"' and '\\')
  // leads back to this very state: then a plain token is allowed without a walk, and any other
  // token is decided by what follows its plain prefix (as JsonObjectConstraint's shortcut).
  GrammarMatcher a = matcher_, b = matcher_;
  bool fixed_point = true;
  for (int byte = 0x20; byte <= 0x7E && fixed_point; ++byte) {
    if (!is_plain(static_cast<uint8_t>(byte))) continue;
    fixed_point = matcher_.advance_to(static_cast<uint8_t>(byte), a) == GrammarMatcher::Step::kOk &&
                  a.same_state(matcher_);
  }
  if (fixed_point) {
    bool exhausted = false;
    for (size_t id = 0; id < vocabulary_->bytes.size(); ++id) {
      const std::string& bytes = vocabulary_->bytes[id];
      if (bytes.empty()) continue;
      if (vocabulary_->plain_in_string[id]) {
        open[id] = 1;
        continue;
      }
      size_t k = 0;
      while (k < bytes.size() && is_plain(static_cast<uint8_t>(bytes[k]))) ++k;
      const GrammarMatcher::Step s = advance_over(matcher_, std::string_view(bytes).substr(k), a, b);
      if (s == GrammarMatcher::Step::kExhausted) exhausted = true;
      if (s == GrammarMatcher::Step::kOk) open[id] = 1;
    }
    return !exhausted;
  }
  std::vector<GrammarMatcher> scratch(trie_->max_depth + 1, matcher_);
  TrieWalk w{*trie_, scratch, open};
  w.walk(0, matcher_, 0);
  return !w.exhausted;
}

Status JsonSchemaConstraint::mask(std::span<float> logits) const {
  std::vector<uint32_t> key = matcher_.state_key();
  std::vector<uint8_t> open;
  {
    std::lock_guard lock(cache_->mu);
    for (const auto& [k, cached] : cache_->entries) {
      if (k == key) {
        open = cached;
        break;
      }
    }
  }
  if (open.empty()) {
    open.assign(vocabulary_->bytes.size(), 0);
    if (!compute_open(open)) {
      return resource_exhausted("JSON schema: the grammar's parse stacks exploded (more than " +
                                std::to_string(GrammarMatcher::kMaxStacks) + ")");
    }
    std::lock_guard lock(cache_->mu);
    if (cache_->entries.size() >= MaskCache::kEntries) cache_->entries.erase(cache_->entries.begin());
    cache_->entries.emplace_back(std::move(key), open);
  }
  size_t allowed = 0;
  for (size_t id = 0; id < logits.size(); ++id) {
    if (id < open.size() && open[id] != 0) {
      ++allowed;
    } else {
      logits[id] = -std::numeric_limits<float>::infinity();
    }
  }
  if (allowed == 0) {
    return out_of_range(
        "JSON schema: no token of the vocabulary continues the document here");
  }
  return Status::ok();
}

Status JsonSchemaConstraint::accept(TokenId token) {
  if (token < 0 || static_cast<size_t>(token) >= vocabulary_->bytes.size() ||
      vocabulary_->bytes[static_cast<size_t>(token)].empty()) {
    return invalid_argument("JSON schema: token " + std::to_string(token) +
                            " cannot be part of the document");
  }
  switch (matcher_.advance(vocabulary_->bytes[static_cast<size_t>(token)])) {
    case GrammarMatcher::Step::kOk:
      return Status::ok();
    case GrammarMatcher::Step::kExhausted:
      return resource_exhausted("JSON schema: the grammar's parse stacks exploded at token " +
                                std::to_string(token));
    case GrammarMatcher::Step::kRefused:
      break;
  }
  return invalid_argument("JSON schema: token " + std::to_string(token) +
                          " does not continue a document valid against the schema");
}

std::unique_ptr<TokenConstraint> JsonSchemaConstraint::clone() const {
  return std::unique_ptr<TokenConstraint>(new JsonSchemaConstraint(*this));
}

}  // namespace specontext
