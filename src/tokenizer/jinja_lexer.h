// Splits a Jinja template into text and tags (applying -, trim_blocks and lstrip_blocks
// whitespace control), and a tag's inside into expression tokens.
#pragma once
#include <string>
#include <vector>

namespace msa::jinja {

struct Chunk {
  enum class Kind { text, output, statement } kind;
  std::string text;  // the text, or the inside of the tag without its delimiters
  int line;
};

struct Token {
  enum class Kind { name, string, integer, number, op, end } kind;
  std::string text;  // name, operator, or the string's decoded value
  int line;
};

std::vector<Chunk> split_template(const std::string& source);
std::vector<Token> lex_expression(const std::string& text, int line);

}  // namespace msa::jinja
