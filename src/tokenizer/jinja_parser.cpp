// Recursive-descent parser for the Jinja subset, with Jinja's operator precedence:
// conditional < or < and < not < comparisons/in < + - < ~ < * / // % < unary - <
// postfix (.attr, [i], [a:b], call) and filters/tests.
#include <cstdint>
#include <algorithm>
#include <cerrno>
#include <cstdlib>

#include "msa/error.h"
#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_lexer.h"

namespace msa::jinja {
namespace {

class ExprParser {
 public:
  ExprParser(std::vector<Token> tokens) : tokens_(std::move(tokens)) {}

  ExprPtr expression() { return conditional(); }
  const Token& peek(size_t ahead = 0) const { return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)]; }
  bool at_end() const { return peek().kind == Token::Kind::end; }
  bool is_op(const char* op, size_t ahead = 0) const { return peek(ahead).kind == Token::Kind::op && peek(ahead).text == op; }
  bool is_word(const char* word, size_t ahead = 0) const { return peek(ahead).kind == Token::Kind::name && peek(ahead).text == word; }
  [[noreturn]] void fail(const std::string& what) const {
    MSA_FAIL("chat template line ", peek().line, ": ", what, ", got '", peek().text, "'");
  }
  void expect_op(const char* op) {
    if (!is_op(op)) fail(std::string("expected '") + op + "'");
    ++pos_;
  }
  std::string expect_name() {
    if (peek().kind != Token::Kind::name) fail("expected a name");
    return tokens_[pos_++].text;
  }
  void expect_end() {
    if (!at_end()) fail("unexpected token");
  }

 private:
  // Counts the recursion of the descent (one level per nested parenthesis, unary operator,
  // conditional, ...): `((((...` must fail cleanly, not overflow the stack.
  struct Nesting {
    explicit Nesting(ExprParser& parser) : parser_(parser) {
      if (++parser_.nesting_ > kMaxExprDepth / 2)
        parser_.fail("expression nested deeper than " + std::to_string(kMaxExprDepth / 2) + " levels");
    }
    ~Nesting() { --parser_.nesting_; }
    ExprParser& parser_;
  };

  // Recomputes e's depth from its children (after they change) and bounds it.
  void finish(Expr& e) {
    int depth = 0;
    for (const ExprPtr& arg : e.args)
      if (arg) depth = std::max(depth, arg->depth);
    for (const auto& [key, arg] : e.kwargs)
      if (arg) depth = std::max(depth, arg->depth);
    e.depth = depth + 1;
    if (e.depth > kMaxExprDepth)
      fail("expression nested deeper than " + std::to_string(kMaxExprDepth) +
           " levels (counting chains such as a ~ b ~ c)");
  }

  ExprPtr make(Expr::Kind kind, std::vector<ExprPtr> args, std::string name = {}) {
    auto e = std::make_shared<Expr>();
    e->kind = kind;
    e->line = peek().line;
    e->args = std::move(args);
    e->name = std::move(name);
    finish(*e);
    return e;
  }

  ExprPtr conditional() {
    Nesting nesting(*this);
    ExprPtr value = logical_or();
    if (is_word("if")) {
      ++pos_;
      ExprPtr condition = logical_or();
      ExprPtr otherwise;
      if (is_word("else")) {
        ++pos_;
        otherwise = conditional();
      }
      return make(Expr::Kind::conditional, {value, condition, otherwise});
    }
    return value;
  }
  ExprPtr logical_or() {
    ExprPtr left = logical_and();
    while (is_word("or")) {
      ++pos_;
      left = make(Expr::Kind::binary, {left, logical_and()}, "or");
    }
    return left;
  }
  ExprPtr logical_and() {
    ExprPtr left = logical_not();
    while (is_word("and")) {
      ++pos_;
      left = make(Expr::Kind::binary, {left, logical_not()}, "and");
    }
    return left;
  }
  ExprPtr logical_not() {
    if (is_word("not")) {
      Nesting nesting(*this);
      ++pos_;
      return make(Expr::Kind::logical_not, {logical_not()});
    }
    return comparison();
  }
  ExprPtr comparison() {
    ExprPtr left = additive();
    for (;;) {
      static const char* ops[] = {"==", "!=", "<", ">", "<=", ">="};
      bool matched = false;
      for (const char* op : ops) {
        if (is_op(op)) {
          ++pos_;
          left = make(Expr::Kind::binary, {left, additive()}, op);
          matched = true;
          break;
        }
      }
      if (matched) continue;
      if (is_word("in") || (is_word("not") && is_word("in", 1))) {
        const bool negated = is_word("not");
        pos_ += negated ? 2 : 1;
        auto e = std::const_pointer_cast<Expr>(make(Expr::Kind::binary, {left, additive()}, "in"));
        e->negated = negated;
        left = e;
        continue;
      }
      return left;
    }
  }
  ExprPtr additive() {
    ExprPtr left = concat();
    while (is_op("+") || is_op("-")) {
      const std::string op = tokens_[pos_++].text;
      left = make(Expr::Kind::binary, {left, concat()}, op);
    }
    return left;
  }
  ExprPtr concat() {
    ExprPtr left = multiplicative();
    while (is_op("~")) {
      ++pos_;
      left = make(Expr::Kind::binary, {left, multiplicative()}, "~");
    }
    return left;
  }
  ExprPtr multiplicative() {
    ExprPtr left = unary();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      const std::string op = tokens_[pos_++].text;
      left = make(Expr::Kind::binary, {left, unary()}, op);
    }
    return left;
  }
  ExprPtr unary() {
    if (is_op("-")) {
      Nesting nesting(*this);
      ++pos_;
      return make(Expr::Kind::negate, {unary()});
    }
    if (is_op("+")) {
      Nesting nesting(*this);
      ++pos_;
      return unary();
    }
    return filters(postfix(primary()));
  }
  void call_arguments(Expr& call) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().kind == Token::Kind::name && is_op("=", 1)) {
        std::string key = expect_name();
        ++pos_;
        call.kwargs.emplace_back(std::move(key), expression());
      } else {
        call.args.push_back(expression());
      }
      if (!is_op(")")) expect_op(",");
    }
    ++pos_;
    finish(call);
  }
  ExprPtr filters(ExprPtr value) {
    for (;;) {
      if (is_op("|")) {
        ++pos_;
        auto e = std::const_pointer_cast<Expr>(make(Expr::Kind::filter, {value}, expect_name()));
        if (is_op("(")) call_arguments(*e);
        value = e;
      } else if (is_word("is")) {
        ++pos_;
        const bool negated = is_word("not");
        if (negated) ++pos_;
        auto e = std::const_pointer_cast<Expr>(make(Expr::Kind::test, {value}, expect_name()));
        e->negated = negated;
        if (is_op("(")) {
          call_arguments(*e);
        } else if (!at_end() && (peek().kind == Token::Kind::string || peek().kind == Token::Kind::integer ||
                                 peek().kind == Token::Kind::number)) {
          e->args.push_back(primary());  // "is sameas x" / "is eq 3" style argument
          finish(*e);
        }
        value = e;
      } else {
        return value;
      }
    }
  }
  ExprPtr postfix(ExprPtr value) {
    for (;;) {
      if (is_op(".")) {
        ++pos_;
        value = make(Expr::Kind::attribute, {value}, expect_name());
      } else if (is_op("[")) {
        ++pos_;
        ExprPtr parts[3];
        int part = 0;
        bool is_slice = false;
        while (!is_op("]")) {
          if (is_op(":")) {
            ++pos_;
            is_slice = true;
            if (++part > 2) fail("too many ':' in slice");
            continue;
          }
          parts[part] = expression();
        }
        ++pos_;
        if (is_slice) {
          value = make(Expr::Kind::slice, {value, parts[0], parts[1], parts[2]});
        } else {
          if (!parts[0]) fail("empty subscript");
          value = make(Expr::Kind::subscript, {value, parts[0]});
        }
      } else if (is_op("(")) {
        auto e = std::const_pointer_cast<Expr>(make(Expr::Kind::call, {value}));
        call_arguments(*e);
        value = e;
      } else {
        return value;
      }
    }
  }
  ExprPtr literal(Value v) {
    auto e = std::const_pointer_cast<Expr>(make(Expr::Kind::literal, {}));
    e->value = std::move(v);
    return e;
  }
  ExprPtr primary() {
    const Token& t = peek();
    switch (t.kind) {
      case Token::Kind::string: {
        ++pos_;
        std::string s = t.text;
        while (peek().kind == Token::Kind::string) s += tokens_[pos_++].text;  // "a" "b"
        return literal(Value(std::move(s)));
      }
      case Token::Kind::integer: {
        errno = 0;
        const long long value = std::strtoll(t.text.c_str(), nullptr, 10);
        if (errno == ERANGE) fail("an integer literal beyond 64 bits");
        ++pos_;
        return literal(Value(int64_t(value)));
      }
      case Token::Kind::number: ++pos_; return literal(Value(std::strtod(t.text.c_str(), nullptr)));
      case Token::Kind::name: {
        ++pos_;
        if (t.text == "true" || t.text == "True") return literal(Value(true));
        if (t.text == "false" || t.text == "False") return literal(Value(false));
        if (t.text == "none" || t.text == "None") return literal(Value(None{}));
        return make(Expr::Kind::name, {}, t.text);
      }
      case Token::Kind::op:
        if (t.text == "(") {
          ++pos_;
          ExprPtr inner = expression();
          if (is_op(",")) {  // a tuple, kept as a list
            std::vector<ExprPtr> items{inner};
            while (is_op(",")) {
              ++pos_;
              if (is_op(")")) break;
              items.push_back(expression());
            }
            inner = make(Expr::Kind::list, std::move(items));
          }
          expect_op(")");
          return inner;
        }
        if (t.text == "[") {
          ++pos_;
          std::vector<ExprPtr> items;
          while (!is_op("]")) {
            items.push_back(expression());
            if (!is_op("]")) expect_op(",");
          }
          ++pos_;
          return make(Expr::Kind::list, std::move(items));
        }
        if (t.text == "{") {
          ++pos_;
          auto e = std::const_pointer_cast<Expr>(make(Expr::Kind::dict, {}));
          while (!is_op("}")) {
            if (peek().kind != Token::Kind::string) fail("expected a string key");
            std::string key = tokens_[pos_++].text;
            expect_op(":");
            e->kwargs.emplace_back(std::move(key), expression());
            if (!is_op("}")) expect_op(",");
          }
          ++pos_;
          finish(*e);
          return e;
        }
        break;
      default: break;
    }
    fail("expected an expression");
  }

  std::vector<Token> tokens_;
  size_t pos_ = 0;
  int nesting_ = 0;

 public:
  size_t& position() { return pos_; }
};

Node make_node(Node::Kind kind, int line) {
  Node node;
  node.kind = kind;
  node.line = line;
  return node;
}

class TemplateParser {
 public:
  explicit TemplateParser(std::vector<Chunk> chunks) : chunks_(std::move(chunks)) {}

  // Parses nodes until a statement whose keyword is in `stops` (returned, not consumed
  // beyond its keyword) or the end of the template.
  std::vector<Node> parse_body(const std::vector<std::string>& stops, std::string* stopped_at,
                               ExprParser** stop_parser) {
    struct Nesting {
      explicit Nesting(int& depth) : depth_(depth) { ++depth_; }
      ~Nesting() { --depth_; }
      int& depth_;
    } nesting(depth_);
    if (depth_ > kMaxBlockDepth)
      MSA_FAIL("chat template line ", index_ < chunks_.size() ? chunks_[index_].line : 0,
               ": blocks nested deeper than ", kMaxBlockDepth, " levels");
    std::vector<Node> nodes;
    while (index_ < chunks_.size()) {
      const Chunk& chunk = chunks_[index_++];
      if (chunk.kind == Chunk::Kind::text) {
        Node node = make_node(Node::Kind::text, chunk.line);
        node.text = chunk.text;
        nodes.push_back(std::move(node));
        continue;
      }
      auto parser = std::make_unique<ExprParser>(lex_expression(chunk.text, chunk.line));
      if (chunk.kind == Chunk::Kind::output) {
        Node node = make_node(Node::Kind::output, chunk.line);
        node.expr = parser->expression();
        parser->expect_end();
        nodes.push_back(std::move(node));
        continue;
      }
      const std::string keyword = parser->expect_name();
      for (const auto& stop : stops) {
        if (keyword == stop) {
          *stopped_at = keyword;
          current_ = std::move(parser);
          *stop_parser = current_.get();
          return nodes;
        }
      }
      if (keyword == "for") {
        nodes.push_back(parse_for(*parser, chunk.line));
      } else if (keyword == "if") {
        nodes.push_back(parse_if(*parser, chunk.line));
      } else if (keyword == "set") {
        nodes.push_back(parse_set(*parser, chunk.line));
      } else if (keyword == "generation" || keyword == "endgeneration") {
        parser->expect_end();  // transformers' assistant-mask markers: no output
      } else {
        MSA_FAIL("chat template line ", chunk.line, ": unsupported statement '", keyword, "'");
      }
    }
    if (!stops.empty()) MSA_FAIL("chat template: missing {% ", stops.back(), " %} at the end");
    return nodes;
  }

 private:
  Node parse_for(ExprParser& parser, int line) {
    Node node = make_node(Node::Kind::for_loop, line);
    node.targets.push_back(parser.expect_name());
    while (parser.is_op(",")) {
      ++parser.position();
      node.targets.push_back(parser.expect_name());
    }
    if (!parser.is_word("in")) parser.fail("expected 'in'");
    ++parser.position();
    // The iterable is parsed below the conditional level so that "if" starts a filter.
    node.expr = parse_iterable(parser);
    if (parser.is_word("if")) {
      ++parser.position();
      node.filter = parser.expression();
    }
    parser.expect_end();
    std::string stop;
    ExprParser* stop_parser = nullptr;
    node.body = parse_body({"else", "endfor"}, &stop, &stop_parser);
    stop_parser->expect_end();
    if (stop == "else") {
      node.else_body = parse_body({"endfor"}, &stop, &stop_parser);
      stop_parser->expect_end();
    }
    return node;
  }
  static ExprPtr parse_iterable(ExprParser& parser) {
    // Parse a full expression, then undo a trailing "x if cond" that belongs to the loop.
    const size_t start = parser.position();
    size_t depth = 0, end = start;
    for (size_t i = start;; ++i) {
      const Token& t = parser.peek(i - start);
      if (t.kind == Token::Kind::end) { end = i; break; }
      if (t.kind == Token::Kind::op && (t.text == "(" || t.text == "[" || t.text == "{")) ++depth;
      if (t.kind == Token::Kind::op && (t.text == ")" || t.text == "]" || t.text == "}")) --depth;
      if (depth == 0 && t.kind == Token::Kind::name && t.text == "if") { end = i; break; }
    }
    std::vector<Token> tokens;
    for (size_t i = start; i < end; ++i) tokens.push_back(parser.peek(i - start));
    tokens.push_back({Token::Kind::end, "", parser.peek().line});
    ExprParser sub(std::move(tokens));
    ExprPtr iterable = sub.expression();
    sub.expect_end();
    parser.position() = end;
    return iterable;
  }
  Node parse_if(ExprParser& parser, int line) {
    Node node = make_node(Node::Kind::if_chain, line);
    ExprPtr condition = parser.expression();
    parser.expect_end();
    for (;;) {
      std::string stop;
      ExprParser* stop_parser = nullptr;
      std::vector<Node> body = parse_body({"elif", "else", "endif"}, &stop, &stop_parser);
      node.branches.emplace_back(condition, std::move(body));
      if (stop == "endif") {
        stop_parser->expect_end();
        return node;
      }
      if (stop == "elif") {
        condition = stop_parser->expression();
        stop_parser->expect_end();
      } else {
        stop_parser->expect_end();
        std::vector<Node> else_body = parse_body({"endif"}, &stop, &stop_parser);
        stop_parser->expect_end();
        node.branches.emplace_back(nullptr, std::move(else_body));
        return node;
      }
    }
  }
  Node parse_set(ExprParser& parser, int line) {
    Node node = make_node(Node::Kind::set, line);
    node.targets.push_back(parser.expect_name());
    if (parser.is_op(".")) {
      ++parser.position();
      node.targets.push_back(parser.expect_name());
    }
    parser.expect_op("=");
    node.expr = parser.expression();
    parser.expect_end();
    return node;
  }

  std::vector<Chunk> chunks_;
  size_t index_ = 0;
  int depth_ = 0;
  std::unique_ptr<ExprParser> current_;
};

}  // namespace

std::vector<Node> parse_template(const std::string& source) {
  TemplateParser parser(split_template(source));
  std::string stop;
  ExprParser* stop_parser = nullptr;
  return parser.parse_body({}, &stop, &stop_parser);
}

}  // namespace msa::jinja
