#include "core/json_parse.h"
#include "msa/error.h"
#include "msa/tokenizer.h"
#include "tokenizer/jinja_ast.h"
#include <cstdint>

namespace msa {

ChatTemplate::ChatTemplate(std::shared_ptr<const Program> program) : program_(std::move(program)) {}

ChatTemplate ChatTemplate::from_string(std::string source) {
  auto program = std::make_shared<Program>();
  program->nodes = jinja::parse_template(source);
  program->source = std::move(source);
  return ChatTemplate(std::move(program));
}

const std::string& ChatTemplate::source() const { return program_->source; }

std::string ChatTemplate::render_json(std::string_view context_json, uint64_t work_limit) const {
  nlohmann::ordered_json context;
  try {
    context = parse_ordered_json_limited(context_json);
  } catch (const JsonParseError& e) {
    MSA_FAIL("chat template context: ", e.what());
  }
  if (!context.is_object()) MSA_FAIL("chat template context: expected a JSON object");
  const jinja::Value globals = jinja::from_json(context);
  return jinja::render(program_->nodes, globals.dict(), work_limit);
}

}  // namespace msa
