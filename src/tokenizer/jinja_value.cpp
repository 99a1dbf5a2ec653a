#include "tokenizer/jinja_value.h"

#include <cstdint>
#include <algorithm>
#include <cmath>
#include <cstdio>

#include "msa/error.h"

namespace msa::jinja {
namespace {

std::string format_float(double d) {
  // Python's repr of a float: shortest round-trip digits, always with '.0' or an exponent.
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buffer[32];
  for (int precision = 1; precision <= 17; ++precision) {
    std::snprintf(buffer, sizeof(buffer), "%.*g", precision, d);
    if (std::strtod(buffer, nullptr) == d) break;
  }
  std::string out = buffer;
  if (out.find_first_of(".eninf") == std::string::npos) out += ".0";
  return out;
}

void json_string(const std::string& s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20 || c == 0x7F) {
          char buffer[8];
          std::snprintf(buffer, sizeof(buffer), "\\u%04x", c);
          out += buffer;
        } else {
          out += char(c);
        }
    }
  }
  out += '"';
}

void to_json_into(const Value& value, int indent, int depth, std::string& out) {
  auto newline = [&](int level) {
    const size_t spaces = size_t(indent) * size_t(level);
    spend_bytes(spaces);
    out += '\n';
    out.append(spaces, ' ');
  };
  spend(1);
  if (value.is_undefined() || value.is_none()) {
    out += "null";
  } else if (value.is_bool()) {
    out += std::get<bool>(value.v) ? "true" : "false";
  } else if (value.is_int()) {
    out += std::to_string(value.integer());
  } else if (value.is_float()) {
    const double d = std::get<double>(value.v);
    out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : format_float(d);
  } else if (value.is_string()) {
    spend_bytes(value.str().size() * 6);  // \u00XX escapes at most
    json_string(value.str(), out);
  } else if (value.is_list()) {
    const List& list = value.list();
    out += '[';
    for (size_t i = 0; i < list.size(); ++i) {
      if (i) out += indent >= 0 ? "," : ", ";
      if (indent >= 0) newline(depth + 1);
      to_json_into(list[i], indent, depth + 1, out);
    }
    if (indent >= 0 && !list.empty()) newline(depth);
    out += ']';
  } else {
    const Dict& dict = value.dict();
    out += '{';
    for (size_t i = 0; i < dict.items.size(); ++i) {
      if (i) out += indent >= 0 ? "," : ", ";
      if (indent >= 0) newline(depth + 1);
      json_string(dict.items[i].first, out);
      out += ": ";
      to_json_into(dict.items[i].second, indent, depth + 1, out);
    }
    if (indent >= 0 && !dict.items.empty()) newline(depth);
    out += '}';
  }
}

}  // namespace

namespace {
thread_local WorkBudget* current_budget = nullptr;
}  // namespace

WorkBudget::WorkBudget(uint64_t limit) : limit(limit), previous_(current_budget) { current_budget = this; }
WorkBudget::~WorkBudget() { current_budget = previous_; }

uint64_t work_limit() { return current_budget ? current_budget->limit : uint64_t{1} << 24; }

void spend(uint64_t units) {
  WorkBudget* budget = current_budget;
  if (budget == nullptr) return;
  budget->used += units;
  if (budget->used > budget->limit)
    MSA_FAIL("chat template: rendering exceeds its work limit (", budget->limit,
             " units of evaluation steps, list items and 16-byte pieces of text): the template "
             "loops or builds values without bound");
}

namespace {
[[noreturn]] void too_deep() {
  MSA_FAIL("chat template: a value nested deeper than ", kMaxValueDepth, " levels");
}
}  // namespace

Value::Value(List list) {
  spend_items(list.size());
  for (const Value& item : list) {
    depth = std::max(depth, item.depth + 1);
    holds_namespace = holds_namespace || item.holds_namespace;
  }
  depth = std::max(depth, 1);
  if (depth > kMaxValueDepth) too_deep();
  v = std::make_shared<List>(std::move(list));
}

Value::Value(Dict dict) {
  spend_items(dict.items.size());
  holds_namespace = dict.is_namespace;
  for (const auto& [key, item] : dict.items) {
    depth = std::max(depth, item.depth + 1);
    holds_namespace = holds_namespace || item.holds_namespace;
  }
  depth = std::max(depth, 1);
  if (depth > kMaxValueDepth) too_deep();
  v = std::make_shared<Dict>(std::move(dict));
}

// Linear in the items (dicts here are small: messages, tool calls); charged so that a loop of
// lookups in a large dict cannot run unbounded.
const Value* Dict::find(const std::string& key) const {
  spend(items.size() / 4 + 1);
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(const std::string& key, Value value) {
  spend(items.size() / 4 + 1);
  for (auto& [k, v] : items) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(key, std::move(value));
}

bool Value::truthy() const {
  if (is_undefined() || is_none()) return false;
  if (is_bool()) return std::get<bool>(v);
  if (is_int()) return integer() != 0;
  if (is_float()) return number() != 0.0;
  if (is_string()) return !str().empty();
  if (is_list()) return !list().empty();
  return dict().is_namespace || !dict().items.empty();
}

std::string Value::to_output() const {
  if (is_undefined()) return "";
  if (is_string()) return str();
  return repr();
}

namespace {
void string_repr_into(const std::string& s, std::string& out) {
  spend_bytes(2 * s.size());
  const char quote = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  out += quote;
  for (char c : s) {
    if (c == quote || c == '\\') out += '\\';
    if (c == '\n') out += "\\n";
    else if (c == '\t') out += "\\t";
    else if (c == '\r') out += "\\r";
    else out += c;
  }
  out += quote;
}
}  // namespace

// Appends to one buffer (linear in the output; concatenating each level's string would copy
// the text once per level), stopping once `out` is longer than `limit`.
void Value::repr_into(std::string& out, size_t limit) const {
  spend(1);
  if (out.size() > limit) return;
  if (is_undefined()) return;
  if (is_none()) out += "None";
  else if (is_bool()) out += std::get<bool>(v) ? "True" : "False";
  else if (is_int()) out += std::to_string(integer());
  else if (is_float()) out += format_float(number());
  else if (is_string()) string_repr_into(str(), out);
  else if (is_list()) {
    out += '[';
    for (size_t i = 0; i < list().size() && out.size() <= limit; ++i) {
      if (i) out += ", ";
      list()[i].repr_into(out, limit);
    }
    out += ']';
  } else if (dict().is_namespace) {
    out += "<Namespace>";
  } else {
    out += '{';
    for (size_t i = 0; i < dict().items.size() && out.size() <= limit; ++i) {
      if (i) out += ", ";
      string_repr_into(dict().items[i].first, out);
      out += ": ";
      dict().items[i].second.repr_into(out, limit);
    }
    out += '}';
  }
}

std::string Value::repr() const {
  std::string out;
  repr_into(out);
  return out;
}

std::string Value::short_repr() const {
  constexpr size_t kMax = 80;
  std::string out;
  repr_into(out, kMax);
  if (out.size() > kMax) out = out.substr(0, kMax - 3) + "...";
  return out;
}

void Value::wrong_type(const char* expected) const {
  MSA_FAIL("chat template: expected ", expected, ", got ", type_name(), " ", short_repr());
}

const char* Value::type_name() const {
  static const char* names[] = {"undefined", "none", "bool", "int", "float", "string", "list", "dict"};
  return names[v.index()];
}

bool equals(const Value& a, const Value& b) {
  spend(1);
  if ((a.is_number() || a.is_bool()) && (b.is_number() || b.is_bool())) {
    auto num = [](const Value& x) { return x.is_bool() ? double(std::get<bool>(x.v)) : x.number(); };
    return num(a) == num(b);
  }
  if (a.v.index() != b.v.index()) return false;
  if (a.is_undefined() || a.is_none()) return true;
  if (a.is_string()) {
    spend_bytes(std::min(a.str().size(), b.str().size()));
    return a.str() == b.str();
  }
  if (a.is_list()) {
    if (&a.list() == &b.list()) return true;
    if (a.list().size() != b.list().size()) return false;
    for (size_t i = 0; i < a.list().size(); ++i)
      if (!equals(a.list()[i], b.list()[i])) return false;
    return true;
  }
  const Dict &x = a.dict(), &y = b.dict();
  if (&x == &y) return true;
  if (x.items.size() != y.items.size()) return false;
  for (const auto& [k, v] : x.items) {
    const Value* other = y.find(k);
    if (!other || !equals(v, *other)) return false;
  }
  return true;
}

int compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.number() < b.number() ? -1 : a.number() > b.number() ? 1 : 0;
  if (a.is_string() && b.is_string()) {
    spend_bytes(std::min(a.str().size(), b.str().size()));
    return a.str() < b.str() ? -1 : a.str() > b.str() ? 1 : 0;
  }
  MSA_FAIL("chat template: cannot order ", a.type_name(), " and ", b.type_name());
}

Value from_json(const nlohmann::ordered_json& json) {
  switch (json.type()) {
    case nlohmann::ordered_json::value_t::null: return Value(None{});
    case nlohmann::ordered_json::value_t::boolean: return Value(json.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer: return Value(json.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = json.get<uint64_t>();
      return u <= uint64_t(INT64_MAX) ? Value(int64_t(u)) : Value(double(u));
    }
    case nlohmann::ordered_json::value_t::number_float: return Value(json.get<double>());
    case nlohmann::ordered_json::value_t::string: return Value(json.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List list;
      for (const auto& item : json) list.push_back(from_json(item));
      return Value(std::move(list));
    }
    case nlohmann::ordered_json::value_t::object: {
      Dict dict;
      for (const auto& [key, item] : json.items()) dict.items.emplace_back(key, from_json(item));
      return Value(std::move(dict));
    }
    default: MSA_FAIL("chat template: unsupported JSON value ", json.dump());
  }
}

std::string to_json(const Value& value, int indent) {
  std::string out;
  to_json_into(value, indent, 0, out);
  return out;
}

}  // namespace msa::jinja
