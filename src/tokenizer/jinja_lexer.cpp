#include "tokenizer/jinja_lexer.h"

#include <cstdint>
#include <algorithm>
#include <cctype>

#include "msa/error.h"

namespace msa::jinja {
namespace {

int count_lines(const std::string& s, size_t begin, size_t end) {
  return int(std::count(s.begin() + long(begin), s.begin() + long(end), '\n'));
}

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

}  // namespace

std::vector<Chunk> split_template(const std::string& source) {
  std::vector<Chunk> chunks;
  size_t pos = 0;
  int line = 1;
  bool strip_next = false;      // a "-" closed the previous tag
  bool trim_newline = false;    // trim_blocks after a block or comment tag
  while (pos < source.size()) {
    size_t open = source.find('{', pos);
    while (open != std::string::npos && open + 1 < source.size() &&
           source[open + 1] != '{' && source[open + 1] != '%' && source[open + 1] != '#')
      open = source.find('{', open + 1);
    if (open + 1 >= source.size()) open = std::string::npos;
    std::string text = source.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
    const int text_line = line;
    line += count_lines(source, pos, open == std::string::npos ? source.size() : open);

    bool starts_line = pos == 0 || source[pos - 1] == '\n';
    if (trim_newline && !text.empty() && text[0] == '\n') {
      text.erase(0, 1);
      starts_line = true;
    }
    if (strip_next) text.erase(0, std::min(text.size(), size_t(std::find_if_not(text.begin(), text.end(), is_space) - text.begin())));
    if (open == std::string::npos) {
      if (!text.empty()) chunks.push_back({Chunk::Kind::text, text, text_line});
      break;
    }
    const char kind = source[open + 1];
    const bool minus = open + 2 < source.size() && source[open + 2] == '-';
    const bool plus = open + 2 < source.size() && source[open + 2] == '+';
    if (minus) {
      while (!text.empty() && is_space(text.back())) text.pop_back();
    } else if (kind != '{' && !plus) {
      // lstrip_blocks: drop the spaces and tabs between a line start and a block tag.
      size_t cut = text.size();
      while (cut > 0 && (text[cut - 1] == ' ' || text[cut - 1] == '\t')) --cut;
      if (cut > 0 ? text[cut - 1] == '\n' : starts_line) text.erase(cut);
    }
    if (!text.empty()) chunks.push_back({Chunk::Kind::text, text, text_line});

    const std::string close = kind == '{' ? "}}" : kind == '%' ? "%}" : "#}";
    const size_t inner = open + 2 + ((minus || plus) ? 1 : 0);
    const size_t end = source.find(close, inner);
    if (end == std::string::npos) MSA_FAIL("chat template line ", line, ": unclosed tag '{", kind, "'");
    size_t inner_end = end;
    strip_next = end > inner && source[end - 1] == '-';
    if (strip_next) --inner_end;
    if (kind != '#') {
      chunks.push_back({kind == '{' ? Chunk::Kind::output : Chunk::Kind::statement,
                        source.substr(inner, inner_end - inner), line});
    }
    trim_newline = kind != '{';
    line += count_lines(source, open, end + 2);
    pos = end + 2;
  }
  return chunks;
}

std::vector<Token> lex_expression(const std::string& text, int line) {
  std::vector<Token> tokens;
  size_t pos = 0;
  while (pos < text.size()) {
    const char c = text[pos];
    if (is_space(c)) {
      if (c == '\n') ++line;
      ++pos;
    } else if (std::isalpha(uint8_t(c)) || c == '_') {
      size_t end = pos;
      while (end < text.size() && (std::isalnum(uint8_t(text[end])) || text[end] == '_')) ++end;
      tokens.push_back({Token::Kind::name, text.substr(pos, end - pos), line});
      pos = end;
    } else if (std::isdigit(uint8_t(c))) {
      size_t end = pos;
      while (end < text.size() && std::isdigit(uint8_t(text[end]))) ++end;
      bool is_float = false;
      if (end + 1 < text.size() && text[end] == '.' && std::isdigit(uint8_t(text[end + 1]))) {
        is_float = true;
        ++end;
        while (end < text.size() && std::isdigit(uint8_t(text[end]))) ++end;
      }
      tokens.push_back({is_float ? Token::Kind::number : Token::Kind::integer, text.substr(pos, end - pos), line});
      pos = end;
    } else if (c == '\'' || c == '"') {
      std::string value;
      size_t end = pos + 1;
      while (end < text.size() && text[end] != c) {
        if (text[end] == '\\' && end + 1 < text.size()) {
          const char e = text[++end];
          switch (e) {
            case 'n': value += '\n'; break;
            case 't': value += '\t'; break;
            case 'r': value += '\r'; break;
            case '\\': value += '\\'; break;
            case '\'': value += '\''; break;
            case '"': value += '"'; break;
            default: value += '\\'; value += e;
          }
        } else {
          if (text[end] == '\n') ++line;
          value += text[end];
        }
        ++end;
      }
      if (end >= text.size()) MSA_FAIL("chat template line ", line, ": unterminated string");
      tokens.push_back({Token::Kind::string, value, line});
      pos = end + 1;
    } else {
      static const char* ops[] = {"//", "==", "!=", "<=", ">=", "**", "+", "-", "*", "/", "%", "~", "<",
                                  ">", "(", ")", "[", "]", "{", "}", ",", ".", ":", "|", "="};
      bool found = false;
      for (const char* op : ops) {
        const std::string_view o(op);
        if (text.compare(pos, o.size(), o) == 0) {
          tokens.push_back({Token::Kind::op, std::string(o), line});
          pos += o.size();
          found = true;
          break;
        }
      }
      if (!found) MSA_FAIL("chat template line ", line, ": unexpected character '", c, "'");
    }
  }
  tokens.push_back({Token::Kind::end, "", line});
  return tokens;
}

}  // namespace msa::jinja
