// The parsed form of a Jinja template: expressions and statement nodes.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "msa/tokenizer.h"
#include "tokenizer/jinja_value.h"

namespace msa::jinja {

struct Expr;
using ExprPtr = std::shared_ptr<const Expr>;

struct Expr {
  enum class Kind {
    literal,      // value
    name,         // name
    attribute,    // args[0].name
    subscript,    // args[0][args[1]]
    slice,        // args[0][args[1]:args[2]:args[3]] (null parts left out)
    call,         // args[0](args[1..], kwargs)
    filter,       // args[0] | name(args[1..], kwargs)
    test,         // args[0] is [not] name(args[1..])
    logical_not,  // not args[0]
    negate,       // -args[0]
    binary,       // args[0] op args[1]; op in name: + - * / // % ~ == != < > <= >= in and or
    conditional,  // args[0] if args[1] else args[2] (args[2] may be null)
    list,         // [args...]
    dict,         // {kwargs...} with string keys in kwargs' first
  };
  Kind kind;
  int line = 0;
  std::string name;
  Value value;
  bool negated = false;  // "not in", "is not"
  std::vector<ExprPtr> args;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  int depth = 1;  // of the tree below (evaluating and freeing it recurse this deep)
};

// Parse-time bounds: evaluating, rendering and freeing the parsed template recurse once
// per level, so the nesting a template may have is bounded rather than left to the stack.
// `a ~ b ~ c` chains count too (they parse into left-nested trees).
inline constexpr int kMaxExprDepth = 200;
inline constexpr int kMaxBlockDepth = 100;  // {% for %} / {% if %} inside each other

struct Node {
  enum class Kind { text, output, for_loop, if_chain, set };
  Kind kind;
  int line = 0;
  std::string text;                        // text
  ExprPtr expr;                            // output, set value, for iterable
  std::vector<std::string> targets;        // for: loop variable names; set: name [, attribute]
  ExprPtr filter;                          // for ... if filter
  std::vector<Node> body, else_body;       // for
  std::vector<std::pair<ExprPtr, std::vector<Node>>> branches;  // if/elif/else (else: null)
};

}  // namespace msa::jinja

namespace msa {
struct ChatTemplate::Program {
  std::string source;
  std::vector<jinja::Node> nodes;
};
}  // namespace msa

namespace msa::jinja {
// Parses a template with trim_blocks and lstrip_blocks on, as transformers renders chat
// templates. Syntax errors are msa::Error with the line.
std::vector<Node> parse_template(const std::string& source);
// Renders parsed nodes with the given global variables.
// `work_limit`: see WorkBudget (jinja_value.h).
std::string render(const std::vector<Node>& nodes, const Dict& globals, uint64_t work_limit);
}  // namespace msa::jinja
