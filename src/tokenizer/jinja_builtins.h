// The operations of the Jinja subset on values: item access, `in`, arithmetic, filters,
// tests, methods of strings and dicts, and the globals chat templates call.
#pragma once
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace msa::jinja {

using Kwargs = std::vector<std::pair<std::string, Value>>;

// base.key / base[key]: a missing key is undefined; an attribute of undefined is an error.
Value get_item(const Value& base, const Value& key, int line);
bool contains(const Value& container, const Value& item, int line);
Value arithmetic(const std::string& op, const Value& a, const Value& b, int line);
Value apply_filter(const std::string& name, const std::vector<Value>& args, const Kwargs& kwargs, int line);
bool apply_test(const std::string& name, const std::vector<Value>& args, int line);
Value call_method(const Value& self, const std::string& name, const std::vector<Value>& args,
                  const Kwargs& kwargs, int line);
Value call_global(const std::string& name, const std::vector<Value>& args, const Kwargs& kwargs, int line);
// The code points of UTF-8 text, each as its own string (Python's iteration over a str).
std::vector<std::string> code_points(const std::string& text);
// How many there are (without building them).
size_t count_code_points(const std::string& text);

}  // namespace msa::jinja
