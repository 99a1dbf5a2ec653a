// Errors: every failure names the argument, what was expected and what came.
#pragma once
#include <charconv>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>

namespace msa {

// Thrown for bad input (shapes, dtypes, ids, files) and for failed system calls.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
// Message parts as an ostream would print them by default (integers in decimal, bools as
// 1 / 0, floating point as %g with 6 digits), written without iostreams: an error must be
// formattable in any process, also where this library's standard library shares the process
// with another one whose locale state it cannot reach (a Python extension next to libtorch).
inline void append_part(std::string& out, std::string_view text) { out.append(text); }
inline void append_part(std::string& out, const char* text) { out.append(text); }
inline void append_part(std::string& out, const std::string& text) { out.append(text); }
inline void append_part(std::string& out, char c) { out.push_back(c); }
inline void append_part(std::string& out, bool b) { out.push_back(b ? '1' : '0'); }
// (SFINAE rather than a requires-clause: CUDA sources include this header as C++17.)
template <class T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, char> &&
                                        !std::is_same_v<T, bool>,
                                    int> = 0>
void append_part(std::string& out, T value) {
  char text[32];
  out.append(text, std::to_chars(text, text + sizeof text, value).ptr);
}
template <class T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
void append_part(std::string& out, T value) {
  char text[64];
  out.append(text, std::to_chars(text, text + sizeof text, value, std::chars_format::general, 6).ptr);
}

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::string out;
  (append_part(out, parts), ...);
  return out;
}
}  // namespace detail

// "argument 'q': expected rank 3, got rank 2"
template <class Expected, class Got>
[[noreturn]] void throw_arg_error(const std::string& argument, const Expected& expected,
                                  const Got& got) {
  throw Error(detail::concat("argument '", argument, "': expected ", expected, ", got ", got));
}

}  // namespace msa

// Checks a condition on an argument; the message is built only on failure.
#define MSA_CHECK_ARG(cond, argument, expected, got)      \
  do {                                                    \
    if (!(cond)) ::msa::throw_arg_error(argument, expected, got); \
  } while (0)

#define MSA_FAIL(...) throw ::msa::Error(::msa::detail::concat(__VA_ARGS__))
