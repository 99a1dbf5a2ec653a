// The error every `msa serve` handler throws for a request it refuses: an HTTP status and
// OpenAI's error object ({"error": {"message", "type", "param", "code"}}), so that clients
// (the openai package among them) show the message and the field it names.
#pragma once
#include <stdexcept>
#include <string>

namespace msa::serve {

class ApiError : public std::runtime_error {
 public:
  ApiError(int status, std::string message, std::string param = "",
           std::string type = "invalid_request_error", std::string code = "")
      : std::runtime_error(message), status(status), param(std::move(param)), type(std::move(type)),
        code(std::move(code)) {}

  int status;
  std::string param;  // the request field at fault ("" when none)
  std::string type;   // invalid_request_error, authentication_error, server_error, ...
  std::string code;   // "" or a machine-readable code (queue_full, invalid_api_key, ...)
};

// 400 naming the field: "temperature: expected a number in [0, 2], got string \"hot\"".
[[noreturn]] inline void bad_field(const std::string& field, const std::string& what) {
  throw ApiError(400, field + ": " + what, field);
}

}  // namespace msa::serve
