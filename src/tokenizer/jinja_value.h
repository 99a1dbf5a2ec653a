// Values of the Jinja subset: undefined, none, bool, int, float, string, list, dict
// (insertion-ordered, like Python's), and namespace() objects. Lists, dicts and
// namespaces are shared references, as in Python.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <variant>
#include <vector>

namespace msa::jinja {

struct Value;
using List = std::vector<Value>;
struct Dict {
  std::vector<std::pair<std::string, Value>> items;
  bool is_namespace = false;
  const Value* find(const std::string& key) const;
  void set(const std::string& key, Value value);
};

struct Undefined {
  std::string name;  // what was looked up, for error messages
};
struct None {};

struct Value {
  std::variant<Undefined, None, bool, int64_t, double, std::string, std::shared_ptr<List>,
               std::shared_ptr<Dict>>
      v;

  Value() : v(Undefined{}) {}
  Value(None) : v(None{}) {}
  Value(bool b) : v(b) {}
  Value(int64_t i) : v(i) {}
  Value(int i) : v(int64_t(i)) {}
  Value(double d) : v(d) {}
  Value(std::string s) : v(std::move(s)) {}
  Value(const char* s) : v(std::string(s)) {}
  Value(List list) : v(std::make_shared<List>(std::move(list))) {}
  Value(Dict dict) : v(std::make_shared<Dict>(std::move(dict))) {}
  static Value undefined(std::string name) { Value out; out.v = Undefined{std::move(name)}; return out; }

  bool is_undefined() const { return std::holds_alternative<Undefined>(v); }
  bool is_none() const { return std::holds_alternative<None>(v); }
  bool is_bool() const { return std::holds_alternative<bool>(v); }
  bool is_int() const { return std::holds_alternative<int64_t>(v); }
  bool is_float() const { return std::holds_alternative<double>(v); }
  bool is_number() const { return is_int() || is_float(); }
  bool is_string() const { return std::holds_alternative<std::string>(v); }
  bool is_list() const { return std::holds_alternative<std::shared_ptr<List>>(v); }
  bool is_dict() const { return std::holds_alternative<std::shared_ptr<Dict>>(v); }

  const std::string& str() const { return std::get<std::string>(v); }
  List& list() const { return *std::get<std::shared_ptr<List>>(v); }
  Dict& dict() const { return *std::get<std::shared_ptr<Dict>>(v); }
  double number() const { return is_int() ? double(std::get<int64_t>(v)) : std::get<double>(v); }
  int64_t integer() const { return std::get<int64_t>(v); }

  bool truthy() const;
  // What {{ value }} prints (Python's str()).
  std::string to_output() const;
  // Python's repr(), used for strings inside printed lists and dicts.
  std::string repr() const;
  // The type's name for error messages.
  const char* type_name() const;
};

bool equals(const Value& a, const Value& b);
// -1, 0, 1; numbers with numbers, strings with strings; anything else -> msa::Error.
int compare(const Value& a, const Value& b);

Value from_json(const nlohmann::ordered_json& json);
// json.dumps(value, ensure_ascii=False) with Python's default separators (", ", ": "),
// or with `indent` spaces per level when indent >= 0 (separators "," and ": ").
std::string to_json(const Value& value, int indent = -1);

}  // namespace msa::jinja
