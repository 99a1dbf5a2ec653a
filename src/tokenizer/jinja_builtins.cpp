#include "tokenizer/jinja_builtins.h"

#include <cstdint>
#include <climits>
#include <cmath>

#include "msa/error.h"
#include "tokenizer/unicode_bytes.h"

namespace msa::jinja {
namespace {

[[noreturn]] void fail(int line, const std::string& what) { MSA_FAIL("chat template line ", line, ": ", what); }

bool is_py_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

std::string strip(const std::string& s, const Value* chars, bool left, bool right) {
  spend_search(s.size(), chars && chars->is_string() ? chars->str().size() : 1);
  auto strip_char = [&](char c) {
    return chars && chars->is_string() ? chars->str().find(c) != std::string::npos : is_py_space(c);
  };
  size_t begin = 0, end = s.size();
  if (left) while (begin < end && strip_char(s[begin])) ++begin;
  if (right) while (end > begin && strip_char(s[end - 1])) --end;
  return s.substr(begin, end - begin);
}

Value split(const std::string& s, const Value* sep, int64_t max_split) {
  spend_bytes(s.size());
  List parts;
  if (!sep || sep->is_none()) {  // runs of whitespace, ends ignored
    size_t pos = 0;
    while (pos < s.size()) {
      while (pos < s.size() && is_py_space(s[pos])) ++pos;
      if (pos >= s.size()) break;
      if (max_split >= 0 && int64_t(parts.size()) == max_split) {
        parts.emplace_back(strip(s.substr(pos), nullptr, false, true));
        break;
      }
      size_t end = pos;
      while (end < s.size() && !is_py_space(s[end])) ++end;
      parts.emplace_back(s.substr(pos, end - pos));
      spend_items(1);
      pos = end;
    }
    return Value(std::move(parts));
  }
  if (!sep->is_string())
    MSA_FAIL("chat template: split() separator: expected a string or none, got ", sep->type_name(), " ",
             sep->short_repr());
  const std::string& d = sep->str();
  if (d.empty()) MSA_FAIL("chat template: split() with an empty separator");
  spend_search(s.size(), d.size());
  size_t pos = 0;
  for (;;) {
    const size_t next = s.find(d, pos);
    if (next == std::string::npos || (max_split >= 0 && int64_t(parts.size()) == max_split)) {
      parts.emplace_back(s.substr(pos));
      break;
    }
    parts.emplace_back(s.substr(pos, next - pos));
    spend_items(1);
    pos = next + d.size();
  }
  return Value(std::move(parts));
}

std::string replace_all(std::string s, const std::string& from, const std::string& to) {
  if (from.empty()) return s;
  spend_search(s.size(), from.size());
  uint64_t count = 0;
  for (size_t next = s.find(from); next != std::string::npos; next = s.find(from, next + from.size()))
    ++count;
  spend_bytes(s.size() + count * to.size());  // before building: the result may be huge
  std::string out;
  size_t pos = 0;
  for (size_t next; (next = s.find(from, pos)) != std::string::npos; pos = next + from.size())
    out += s.substr(pos, next - pos) + to;
  return out + s.substr(pos);
}

std::string lower(std::string s, bool upper) {
  spend_bytes(s.size());
  for (char& c : s) c = char(upper ? std::toupper(uint8_t(c)) : std::tolower(uint8_t(c)));
  return s;
}

const Value* arg_or_kwarg(const std::vector<Value>& args, size_t index, const Kwargs& kwargs, const char* name) {
  if (index < args.size()) return &args[index];
  for (const auto& [k, v] : kwargs)
    if (k == name) return &v;
  return nullptr;
}

int64_t length(const Value& v, int line) {
  if (v.is_string()) return int64_t(count_code_points(v.str()));
  if (v.is_list()) return int64_t(v.list().size());
  if (v.is_dict()) return int64_t(v.dict().items.size());
  fail(line, std::string("object of type ") + v.type_name() + " has no length");
}

List items_of(const Value& v, int line) {
  if (!v.is_dict()) fail(line, std::string("items() of ") + v.type_name());
  spend_items(2 * v.dict().items.size());
  List items;
  for (const auto& [k, val] : v.dict().items) items.emplace_back(List{Value(k), val});
  return items;
}

// Integer arithmetic as Python does it, except that a result beyond int64 is an error
// rather than a big integer (and never undefined behaviour).
template <class Op>
int64_t checked(Op op, int64_t x, int64_t y, int line) {
  int64_t result = 0;
  if (op(x, y, &result)) fail(line, "integer overflow (results must fit in 64 bits)");
  return result;
}
bool add_overflows(int64_t x, int64_t y, int64_t* r) { return __builtin_add_overflow(x, y, r); }
bool sub_overflows(int64_t x, int64_t y, int64_t* r) { return __builtin_sub_overflow(x, y, r); }
bool mul_overflows(int64_t x, int64_t y, int64_t* r) { return __builtin_mul_overflow(x, y, r); }

// A double converted to int64 (truncating, as Python's int()); NaN and values beyond int64
// are errors.
int64_t to_int64(double d, int line) {
  if (!(d >= -9223372036854775808.0 && d < 9223372036854775808.0))
    fail(line, "cannot convert " + Value(d).repr() + " to an integer");
  return int64_t(d);
}

}  // namespace

size_t count_code_points(const std::string& text) {
  spend_bytes(text.size());
  size_t count = 0;
  for (size_t pos = 0; pos < text.size(); pos += size_t(tok::utf8_length(uint8_t(text[pos])))) ++count;
  return count;
}

std::vector<std::string> code_points(const std::string& text) {
  spend_items(count_code_points(text));
  std::vector<std::string> out;
  for (size_t pos = 0; pos < text.size();) {
    const size_t n = size_t(tok::utf8_length(uint8_t(text[pos])));
    out.push_back(text.substr(pos, n));
    pos += n;
  }
  return out;
}

Value get_item(const Value& base, const Value& key, int line) {
  if (base.is_undefined())
    fail(line, "'" + std::get<Undefined>(base.v).name + "' is undefined (looking up " + key.short_repr() + ")");
  if (base.is_dict() && key.is_string()) {
    if (const Value* v = base.dict().find(key.str())) return *v;
    return Value::undefined(key.str());
  }
  if ((base.is_list() || base.is_string()) && key.is_int()) {
    const auto n = int64_t(base.is_list() ? base.list().size() : count_code_points(base.str()));
    int64_t i = key.integer();
    if (i < 0) i += n;
    if (i < 0 || i >= n) return Value::undefined("index " + std::to_string(key.integer()));
    if (base.is_list()) return base.list()[size_t(i)];
    const std::string& text = base.str();
    spend_bytes(uint64_t(i) * 4);  // walking i code points of at most 4 bytes
    size_t pos = 0;
    for (int64_t skipped = 0; skipped < i; ++skipped) pos += size_t(tok::utf8_length(uint8_t(text[pos])));
    return Value(text.substr(pos, size_t(tok::utf8_length(uint8_t(text[pos])))));
  }
  return Value::undefined(key.to_output());
}

bool contains(const Value& container, const Value& item, int line) {
  if (container.is_string()) {
    if (!item.is_string()) fail(line, "'in <string>' requires a string on the left");
    spend_search(container.str().size(), item.str().size());
    return container.str().find(item.str()) != std::string::npos;
  }
  if (container.is_list()) {
    for (const Value& v : container.list())
      if (equals(v, item)) return true;
    return false;
  }
  if (container.is_dict()) return item.is_string() && container.dict().find(item.str()) != nullptr;
  fail(line, std::string("argument of type ") + container.type_name() + " is not iterable");
}

Value arithmetic(const std::string& op, const Value& a, const Value& b, int line) {
  if (op == "+") {
    if (a.is_string() && b.is_string()) {
      spend_bytes(a.str().size() + b.str().size());
      return Value(a.str() + b.str());
    }
    if (a.is_list() && b.is_list()) {
      spend_items(a.list().size() + b.list().size());
      List out = a.list();
      out.insert(out.end(), b.list().begin(), b.list().end());
      return Value(std::move(out));
    }
  }
  if (op == "*" && a.is_string() && b.is_int()) {
    const uint64_t times = b.integer() > 0 && !a.str().empty() ? uint64_t(b.integer()) : 0;
    // Charged before building (with a saturating product): "x" * 10**12 must fail, not allocate.
    const uint64_t bytes = a.str().empty() ? 0
                           : times > (uint64_t(1) << 62) / a.str().size() ? (uint64_t(1) << 62)
                                                                           : times * a.str().size();
    spend_bytes(bytes);
    std::string out;
    out.reserve(size_t(bytes));
    for (uint64_t i = 0; i < times; ++i) out += a.str();
    return Value(std::move(out));
  }
  if (!a.is_number() || !b.is_number())
    fail(line, std::string("unsupported operand types for ") + op + ": " + a.type_name() + " and " + b.type_name());
  if (a.is_int() && b.is_int() && op != "/") {
    const int64_t x = a.integer(), y = b.integer();
    if (op == "+") return Value(checked(add_overflows, x, y, line));
    if (op == "-") return Value(checked(sub_overflows, x, y, line));
    if (op == "*") return Value(checked(mul_overflows, x, y, line));
    if (y == 0) fail(line, "division by zero");
    if (y == -1) {  // x / -1 overflows for INT64_MIN; the remainder is always 0
      if (op == "%") return Value(int64_t(0));
      if (op == "//") return Value(checked(sub_overflows, 0, x, line));
    }
    const int64_t q = x / y - ((x % y != 0) && ((x < 0) != (y < 0)) ? 1 : 0);  // floor division
    if (op == "//") return Value(q);
    if (op == "%") return Value(x - q * y);
  }
  const double x = a.number(), y = b.number();
  if (op == "+") return Value(x + y);
  if (op == "-") return Value(x - y);
  if (op == "*") return Value(x * y);
  if (y == 0) fail(line, "division by zero");
  if (op == "/") return Value(x / y);
  if (op == "//") return Value(std::floor(x / y));
  if (op == "%") return Value(x - std::floor(x / y) * y);
  fail(line, "unknown operator " + op);
}

Value apply_filter(const std::string& name, const std::vector<Value>& args, const Kwargs& kwargs, int line) {
  const Value& v = args[0];
  if (name == "trim") return Value(strip(v.to_output(), nullptr, true, true));
  if (name == "length" || name == "count") return Value(length(v, line));
  if (name == "tojson") {
    const Value* indent = arg_or_kwarg(args, 1, kwargs, "indent");
    if (indent && indent->is_int() && (indent->integer() < 0 || indent->integer() > 64))
      fail(line, "tojson(indent=" + std::to_string(indent->integer()) + "): expected an indent in [0, 64]");
    return Value(to_json(v, indent && indent->is_int() ? int(indent->integer()) : -1));
  }
  if (name == "string") return Value(v.to_output());
  if (name == "lower" || name == "upper") return Value(lower(v.to_output(), name == "upper"));
  if (name == "first" || name == "last") {
    if (v.is_list()) {
      if (v.list().empty()) return Value::undefined(name);
      return name == "first" ? v.list().front() : v.list().back();
    }
    if (v.is_string()) {
      const std::string& text = v.str();
      if (text.empty()) return Value::undefined(name);
      if (name == "first") return Value(text.substr(0, size_t(tok::utf8_length(uint8_t(text[0])))));
      size_t last = 0;
      spend_bytes(text.size());
      for (size_t pos = 0; pos < text.size(); pos += size_t(tok::utf8_length(uint8_t(text[pos])))) last = pos;
      return Value(text.substr(last));
    }
    fail(line, "filter " + name + " on " + v.type_name());
  }
  if (name == "join") {
    const Value* sep = arg_or_kwarg(args, 1, kwargs, "d");
    if (!v.is_list()) fail(line, std::string("join of ") + v.type_name());
    const std::string separator = sep ? sep->to_output() : "";
    spend_bytes(v.list().size() * separator.size());
    std::string out;
    for (size_t i = 0; i < v.list().size(); ++i) {
      const std::string item = v.list()[i].to_output();
      spend_bytes(item.size());
      out += (i ? separator : "") + item;
    }
    return Value(std::move(out));
  }
  if (name == "default" || name == "d") {
    const Value* fallback = arg_or_kwarg(args, 1, kwargs, "default_value");
    const Value* boolean = arg_or_kwarg(args, 2, kwargs, "boolean");
    const bool use_fallback = v.is_undefined() || (boolean && boolean->truthy() && !v.truthy());
    return use_fallback ? (fallback ? *fallback : Value(std::string())) : v;
  }
  if (name == "list") {
    if (v.is_list()) return v;
    if (v.is_string()) {
      List out;
      for (auto& c : code_points(v.str())) out.emplace_back(c);
      return Value(std::move(out));
    }
    if (v.is_dict()) {
      List out;
      for (const auto& [k, _] : v.dict().items) out.emplace_back(k);
      return Value(std::move(out));
    }
    fail(line, std::string("list of ") + v.type_name());
  }
  if (name == "items") return Value(items_of(v, line));
  if (name == "reverse") {
    if (v.is_list()) spend_items(v.list().size());
    if (v.is_string()) {
      auto chars = code_points(v.str());
      std::string out;
      for (auto it = chars.rbegin(); it != chars.rend(); ++it) out += *it;
      return Value(std::move(out));
    }
    if (!v.is_list()) fail(line, std::string("reverse of ") + v.type_name());
    return Value(List(v.list().rbegin(), v.list().rend()));
  }
  if (name == "replace" && args.size() >= 3)
    return Value(replace_all(v.to_output(), args[1].to_output(), args[2].to_output()));
  if (name == "int") {
    if (v.is_int()) return v;
    if (v.is_float()) return Value(to_int64(v.number(), line));
    if (v.is_string()) {
      try { return Value(int64_t(std::stoll(v.str()))); } catch (...) { return Value(int64_t(0)); }
    }
    return Value(int64_t(0));
  }
  if (name == "abs" && v.is_number()) {
    if (v.is_float()) return Value(std::fabs(v.number()));
    if (v.integer() == INT64_MIN) fail(line, "integer overflow (results must fit in 64 bits)");
    return Value(int64_t(std::llabs(v.integer())));
  }
  if (name == "safe") return v;
  fail(line, "unsupported filter '" + name + "'");
}

bool apply_test(const std::string& name, const std::vector<Value>& args, int line) {
  const Value& v = args[0];
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.is_int();
  if (name == "float") return v.is_float();
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && std::get<bool>(v.v);
  if (name == "false") return v.is_bool() && !std::get<bool>(v.v);
  if (name == "mapping") return v.is_dict() && !v.dict().is_namespace;
  if (name == "sequence") return v.is_list() || v.is_string() || v.is_dict();
  if (name == "iterable") return v.is_list() || v.is_string() || v.is_dict();
  if ((name == "eq" || name == "equalto" || name == "==") && args.size() == 2) return equals(v, args[1]);
  if ((name == "ne" || name == "!=") && args.size() == 2) return !equals(v, args[1]);
  if (name == "in" && args.size() == 2) return contains(args[1], v, line);
  fail(line, "unsupported test '" + name + "'");
}

Value call_method(const Value& self, const std::string& name, const std::vector<Value>& args,
                  const Kwargs& kwargs, int line) {
  if (self.is_string()) {
    const std::string& s = self.str();
    const Value* a0 = arg_or_kwarg(args, 0, kwargs, "");
    if (name == "strip") return Value(strip(s, a0, true, true));
    if (name == "lstrip") return Value(strip(s, a0, true, false));
    if (name == "rstrip") return Value(strip(s, a0, false, true));
    if (name == "split") {
      const Value* max = arg_or_kwarg(args, 1, kwargs, "maxsplit");
      return split(s, arg_or_kwarg(args, 0, kwargs, "sep"), max && max->is_int() ? max->integer() : -1);
    }
    if ((name == "startswith" || name == "endswith") && a0 && a0->is_string()) {
      const std::string& p = a0->str();
      spend_bytes(p.size());
      if (name == "startswith") return Value(s.compare(0, p.size(), p) == 0);
      return Value(s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0);
    }
    if (name == "lower" || name == "upper") return Value(lower(s, name == "upper"));
    if (name == "replace" && args.size() >= 2) return Value(replace_all(s, args[0].to_output(), args[1].to_output()));
    if (name == "find" && a0 && a0->is_string()) {
      spend_search(s.size(), a0->str().size());
      const size_t at = s.find(a0->str());
      return Value(at == std::string::npos ? int64_t(-1) : int64_t(count_code_points(s.substr(0, at))));
    }
  }
  if (self.is_dict() && !self.dict().is_namespace) {
    if (name == "items") return Value(items_of(self, line));
    if (name == "keys" || name == "values") {
      spend_items(self.dict().items.size());
      List out;
      for (const auto& [k, v] : self.dict().items) out.push_back(name == "keys" ? Value(k) : v);
      return Value(std::move(out));
    }
    if (name == "get" && !args.empty() && args[0].is_string()) {
      if (const Value* v = self.dict().find(args[0].str())) return *v;
      return args.size() > 1 ? args[1] : Value(None{});
    }
  }
  fail(line, std::string("unsupported method '") + name + "' of " + self.type_name());
}

Value call_global(const std::string& name, const std::vector<Value>& args, const Kwargs& kwargs, int line) {
  if (name == "raise_exception")
    MSA_FAIL("chat template: ", args.empty() ? "error" : args[0].to_output().substr(0, 1000));
  if (name == "namespace") {
    Dict ns;
    ns.is_namespace = true;
    for (const auto& [k, v] : kwargs) ns.set(k, v);
    return Value(std::move(ns));
  }
  if (name == "range") {
    int64_t begin = 0, end = 0, step = 1;
    for (const Value& a : args)
      if (!a.is_int()) fail(line, "range() needs integers");
    if (args.size() == 1) end = args[0].integer();
    else if (args.size() >= 2) { begin = args[0].integer(); end = args[1].integer(); }
    if (args.size() == 3) step = args[2].integer();
    if (step == 0) fail(line, "range() step cannot be zero");
    // The length first (in 128 bits: no overflow), charged before anything is built.
    const __int128 span = step > 0 ? __int128(end) - begin : __int128(begin) - end;
    const __int128 magnitude = step > 0 ? __int128(step) : -__int128(step);
    const __int128 count = span <= 0 ? 0 : (span + magnitude - 1) / magnitude;
    if (count > __int128(work_limit() / 4))
      fail(line, "range() of more than " + std::to_string(work_limit() / 4) + " items");
    spend_items(uint64_t(count));
    List out;
    out.reserve(size_t(count));
    for (__int128 k = 0; k < count; ++k) out.emplace_back(int64_t(begin + k * step));
    return Value(std::move(out));
  }
  fail(line, "unknown function '" + name + "'");
}

}  // namespace msa::jinja
