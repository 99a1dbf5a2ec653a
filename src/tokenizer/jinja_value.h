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

// Values nest at most this deep when built (lists and dicts of lists and dicts...): printing,
// comparing and freeing a value recurse once per level, so depth must not follow the input.
inline constexpr int kMaxValueDepth = 256;

struct Value {
  std::variant<Undefined, None, bool, int64_t, double, std::string, std::shared_ptr<List>,
               std::shared_ptr<Dict>>
      v;
  // Nesting depth when the value was built (0 for scalars) and whether a namespace() is
  // inside. Namespaces are the one mutable container; a namespace may not hold a namespace
  // (see the renderer's `set`), so no cycle can form and a value's true depth stays within
  // twice kMaxValueDepth even when a namespace grows after being put in a list.
  int depth = 0;
  bool holds_namespace = false;

  Value() : v(Undefined{}) {}
  Value(None) : v(None{}) {}
  Value(bool b) : v(b) {}
  Value(int64_t i) : v(i) {}
  Value(int i) : v(int64_t(i)) {}
  Value(double d) : v(d) {}
  Value(std::string s) : v(std::move(s)) {}
  Value(const char* s) : v(std::string(s)) {}
  Value(List list);  // msa::Error when nested deeper than kMaxValueDepth
  Value(Dict dict);
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

  // The accessors check the type: a template that hands a builtin the wrong type gets an
  // msa::Error naming both types (wrong_type), never an uncaught std::bad_variant_access.
  const std::string& str() const { return checked<std::string>("a string"); }
  List& list() const { return *checked<std::shared_ptr<List>>("a list"); }
  Dict& dict() const { return *checked<std::shared_ptr<Dict>>("a dict"); }
  double number() const { return is_int() ? double(std::get<int64_t>(v)) : checked<double>("a number"); }
  int64_t integer() const { return checked<int64_t>("an integer"); }

  bool truthy() const;
  // What {{ value }} prints (Python's str()).
  std::string to_output() const;
  // Python's repr(), used for strings inside printed lists and dicts.
  std::string repr() const;
  void repr_into(std::string& out, size_t limit = std::string::npos) const;
  // The start of repr() (80 characters at most), for error messages.
  std::string short_repr() const;
  // The type's name for error messages.
  const char* type_name() const;

 private:
  [[noreturn]] void wrong_type(const char* expected) const;
  template <class T>
  const T& checked(const char* expected) const {
    if (const T* value = std::get_if<T>(&v)) return *value;
    wrong_type(expected);
  }

 public:
};

// Work accounting of one render. Templates come from model directories and messages from
// users: neither may make a render run for minutes or take all memory, and lists are shared
// references, so a few lines can build a value whose printing visits 4^20 elements. Every
// evaluation step, list or dict element built or visited, and 16 bytes of text built cost
// units; a render that spends more than its limit fails with an msa::Error.
class WorkBudget {
 public:
  // Installs this budget as the current thread's for its lifetime.
  explicit WorkBudget(uint64_t limit);
  ~WorkBudget();
  WorkBudget(const WorkBudget&) = delete;
  WorkBudget& operator=(const WorkBudget&) = delete;
  uint64_t used = 0;
  const uint64_t limit;

 private:
  WorkBudget* previous_;
};
// The current thread's budget's limit (the largest list a builtin may build), or 2^24.
uint64_t work_limit();
// Charges the current thread's budget (nothing when no render is running).
void spend(uint64_t units);
inline void spend_bytes(uint64_t bytes) { spend(bytes / 16 + 1); }
inline void spend_items(uint64_t items) { spend(items * 4 + 1); }
// A substring search of `needle` bytes in `haystack` bytes: std::string::find is
// O(haystack * needle) at worst, so that is what it is charged.
inline void spend_search(uint64_t haystack, uint64_t needle) {
  const uint64_t h = haystack + 1, n = needle + 1;
  spend(h > (uint64_t{1} << 40) / n ? (uint64_t{1} << 40) : h * n / 16 + 1);
}

bool equals(const Value& a, const Value& b);
// -1, 0, 1; numbers with numbers, strings with strings; anything else -> msa::Error.
int compare(const Value& a, const Value& b);

Value from_json(const nlohmann::ordered_json& json);
// json.dumps(value, ensure_ascii=False) with Python's default separators (", ", ": "),
// or with `indent` spaces per level when indent >= 0 (separators "," and ": ").
std::string to_json(const Value& value, int indent = -1);

}  // namespace msa::jinja
