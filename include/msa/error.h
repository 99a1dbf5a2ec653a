// Errors: every failure names the argument, what was expected and what came.
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace msa {

// Thrown for bad input (shapes, dtypes, ids, files) and for failed system calls.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
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
