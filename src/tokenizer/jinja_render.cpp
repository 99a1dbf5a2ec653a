// Evaluates a parsed template: scopes, loops, filters, tests, methods and globals
// (raise_exception, namespace, range).
#include <cstdint>
#include <algorithm>
#include <climits>
#include <cmath>
#include <unordered_map>

#include "msa/error.h"
#include "tokenizer/jinja_ast.h"
#include "tokenizer/jinja_builtins.h"

namespace msa::jinja {
namespace {

class Renderer {
 public:
  explicit Renderer(const Dict& globals) { scopes_.push_back(globals); }

  void render(const std::vector<Node>& nodes, std::string& out) {
    for (const Node& node : nodes) render(node, out);
  }

 private:
  void render(const Node& node, std::string& out) {
    spend(1);
    switch (node.kind) {
      case Node::Kind::text:
        spend_bytes(node.text.size());
        out += node.text;
        break;
      case Node::Kind::output: {
        const std::string text = eval(*node.expr).to_output();
        spend_bytes(text.size());
        out += text;
        break;
      }
      case Node::Kind::if_chain:
        for (const auto& [condition, body] : node.branches) {
          if (!condition || eval(*condition).truthy()) {
            render(body, out);
            break;
          }
        }
        break;
      case Node::Kind::set: {
        Value value = eval(*node.expr);
        if (node.targets.size() == 1) {
          scopes_.back().set(node.targets[0], std::move(value));
        } else {
          Value target = lookup(node.targets[0]);
          if (!target.is_dict() || !target.dict().is_namespace)
            MSA_FAIL("chat template line ", node.line, ": cannot set attribute '", node.targets[1],
                     "' of '", node.targets[0], "' (only namespace() objects)");
          // The one mutation of a shared container: refusing namespaces here keeps every
          // value acyclic (a namespace holding itself would never be freed and would print
          // forever) and its depth bounded.
          if (value.holds_namespace)
            MSA_FAIL("chat template line ", node.line, ": cannot set '", node.targets[0], ".",
                     node.targets[1], "' to a value holding a namespace() object");
          if (value.depth + 1 > kMaxValueDepth)
            MSA_FAIL("chat template line ", node.line, ": a value nested deeper than ",
                     kMaxValueDepth, " levels");
          target.dict().set(node.targets[1], std::move(value));
        }
        break;
      }
      case Node::Kind::for_loop: render_for(node, out); break;
    }
  }

  void render_for(const Node& node, std::string& out) {
    const Value iterable = eval(*node.expr);
    List items;
    if (iterable.is_list()) {
      spend_items(iterable.list().size());
      items = iterable.list();
    } else if (iterable.is_dict()) {
      spend_items(iterable.dict().items.size());
      for (const auto& [key, _] : iterable.dict().items) items.emplace_back(key);
    } else if (iterable.is_string()) {
      for (auto& c : code_points(iterable.str())) items.emplace_back(std::move(c));
    } else if (!iterable.is_undefined() && !iterable.is_none()) {
      MSA_FAIL("chat template line ", node.line, ": cannot loop over ", iterable.type_name());
    } else if (iterable.is_none()) {
      MSA_FAIL("chat template line ", node.line, ": cannot loop over none");
    }
    if (node.filter) {
      List kept;
      for (const Value& item : items) {
        scopes_.emplace_back();
        bind_targets(node, item);
        if (eval(*node.filter).truthy()) kept.push_back(item);
        scopes_.pop_back();
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      render(node.else_body, out);
      return;
    }
    for (size_t i = 0; i < items.size(); ++i) {
      scopes_.emplace_back();
      Dict loop;
      const auto n = int64_t(items.size()), k = int64_t(i);
      loop.items = {{"index", Value(k + 1)},       {"index0", Value(k)},
                    {"first", Value(i == 0)},      {"last", Value(k == n - 1)},
                    {"length", Value(n)},          {"revindex", Value(n - k)},
                    {"revindex0", Value(n - k - 1)},
                    {"previtem", i > 0 ? items[i - 1] : Value::undefined("loop.previtem")},
                    {"nextitem", k + 1 < n ? items[i + 1] : Value::undefined("loop.nextitem")}};
      scopes_.back().set("loop", Value(std::move(loop)));
      bind_targets(node, items[i]);
      render(node.body, out);
      scopes_.pop_back();
    }
  }

  void bind_targets(const Node& node, const Value& item) {
    if (node.targets.size() == 1) {
      scopes_.back().set(node.targets[0], item);
      return;
    }
    if (!item.is_list() || item.list().size() != node.targets.size())
      MSA_FAIL("chat template line ", node.line, ": cannot unpack ", item.short_repr(), " into ",
               node.targets.size(), " names");
    for (size_t t = 0; t < node.targets.size(); ++t) scopes_.back().set(node.targets[t], item.list()[t]);
  }

  Value lookup(const std::string& name) const {
    for (auto scope = scopes_.rbegin(); scope != scopes_.rend(); ++scope)
      if (const Value* v = scope->find(name)) return *v;
    return Value::undefined(name);
  }

  Value eval(const Expr& e) {
    spend(1);
    Value value = eval_uncharged(e);
    if (value.is_string()) spend_bytes(value.str().size());
    return value;
  }

  Value eval_uncharged(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::literal: return e.value;
      case Expr::Kind::name: return lookup(e.name);
      case Expr::Kind::attribute: return get_item(eval(*e.args[0]), Value(e.name), e.line);
      case Expr::Kind::subscript: return get_item(eval(*e.args[0]), eval(*e.args[1]), e.line);
      case Expr::Kind::slice: return slice(e);
      case Expr::Kind::call: return call(e);
      case Expr::Kind::filter: {
        std::vector<Value> args{eval(*e.args[0])};
        for (size_t i = 1; i < e.args.size(); ++i) args.push_back(eval(*e.args[i]));
        return apply_filter(e.name, args, eval_kwargs(e), e.line);
      }
      case Expr::Kind::test: {
        if (e.name == "defined" || e.name == "undefined") {
          const bool defined = !eval(*e.args[0]).is_undefined();
          return Value((e.name == "defined") == defined ? !e.negated : e.negated);
        }
        std::vector<Value> args;
        for (const auto& arg : e.args) args.push_back(eval(*arg));
        return Value(apply_test(e.name, args, e.line) != e.negated);
      }
      case Expr::Kind::logical_not: return Value(!eval(*e.args[0]).truthy());
      case Expr::Kind::negate: {
        const Value v = eval(*e.args[0]);
        if (v.is_int()) {
          if (v.integer() == INT64_MIN)
            MSA_FAIL("chat template line ", e.line, ": integer overflow (results must fit in 64 bits)");
          return Value(-v.integer());
        }
        if (v.is_float()) return Value(-v.number());
        MSA_FAIL("chat template line ", e.line, ": cannot negate ", v.type_name());
      }
      case Expr::Kind::binary: return binary(e);
      case Expr::Kind::conditional:
        if (eval(*e.args[1]).truthy()) return eval(*e.args[0]);
        return e.args[2] ? eval(*e.args[2]) : Value::undefined("else");
      case Expr::Kind::list: {
        List list;
        for (const auto& item : e.args) list.push_back(eval(*item));
        return Value(std::move(list));
      }
      case Expr::Kind::dict: {
        Dict dict;
        for (const auto& [key, item] : e.kwargs) dict.set(key, eval(*item));
        return Value(std::move(dict));
      }
    }
    return Value();
  }

  std::vector<std::pair<std::string, Value>> eval_kwargs(const Expr& e) {
    std::vector<std::pair<std::string, Value>> kwargs;
    for (const auto& [key, item] : e.kwargs) kwargs.emplace_back(key, eval(*item));
    return kwargs;
  }

  Value slice(const Expr& e) {
    const Value base = eval(*e.args[0]);
    auto bound = [&](size_t i) -> std::optional<int64_t> {
      if (!e.args[i]) return std::nullopt;
      const Value v = eval(*e.args[i]);
      if (v.is_none()) return std::nullopt;
      if (!v.is_int()) MSA_FAIL("chat template line ", e.line, ": slice bounds must be integers");
      return v.integer();
    };
    const auto start = bound(1), stop = bound(2), step_value = bound(3);
    const int64_t step = step_value.value_or(1);
    if (step == 0) MSA_FAIL("chat template line ", e.line, ": slice step cannot be zero");
    const bool is_string = base.is_string();
    if (!is_string && !base.is_list()) MSA_FAIL("chat template line ", e.line, ": cannot slice ", base.type_name());
    const std::vector<std::string> chars = is_string ? code_points(base.str()) : std::vector<std::string>{};
    const auto n = int64_t(is_string ? chars.size() : base.list().size());
    // Python's slice.indices().
    auto clamp = [&](std::optional<int64_t> v, int64_t fallback) {
      if (!v) return fallback;
      int64_t x = *v < 0 ? *v + n : *v;
      if (step > 0) return std::clamp<int64_t>(x, 0, n);
      return std::clamp<int64_t>(x, -1, n - 1);
    };
    const int64_t begin = clamp(start, step > 0 ? 0 : n - 1), end = clamp(stop, step > 0 ? n : -1);
    List items;
    std::string text;
    // In 128 bits: i + step must not overflow for a step near 2^63.
    for (__int128 i = begin; step > 0 ? i < end : i > end; i += step) {
      spend(1);
      if (is_string) text += chars[size_t(i)];
      else items.push_back(base.list()[size_t(i)]);
    }
    return is_string ? Value(std::move(text)) : Value(std::move(items));
  }

  Value call(const Expr& e) {
    std::vector<Value> args;
    for (size_t i = 1; i < e.args.size(); ++i) args.push_back(eval(*e.args[i]));
    auto kwargs = eval_kwargs(e);
    const Expr& callee = *e.args[0];
    if (callee.kind == Expr::Kind::attribute) {
      return call_method(eval(*callee.args[0]), callee.name, args, kwargs, e.line);
    }
    if (callee.kind == Expr::Kind::name && lookup(callee.name).is_undefined())
      return call_global(callee.name, args, kwargs, e.line);
    MSA_FAIL("chat template line ", e.line, ": cannot call this expression");
  }

  Value binary(const Expr& e) {
    const std::string& op = e.name;
    if (op == "and") {
      Value left = eval(*e.args[0]);
      return left.truthy() ? eval(*e.args[1]) : left;
    }
    if (op == "or") {
      Value left = eval(*e.args[0]);
      return left.truthy() ? left : eval(*e.args[1]);
    }
    const Value a = eval(*e.args[0]), b = eval(*e.args[1]);
    if (op == "~") return Value(a.to_output() + b.to_output());
    if (op == "==") return Value(equals(a, b));
    if (op == "!=") return Value(!equals(a, b));
    if (op == "<") return Value(compare(a, b) < 0);
    if (op == ">") return Value(compare(a, b) > 0);
    if (op == "<=") return Value(compare(a, b) <= 0);
    if (op == ">=") return Value(compare(a, b) >= 0);
    if (op == "in") return Value(contains(b, a, e.line) != e.negated);
    return arithmetic(op, a, b, e.line);
  }

  std::vector<Dict> scopes_;
};

}  // namespace

std::string render(const std::vector<Node>& nodes, const Dict& globals, uint64_t work_limit) {
  WorkBudget budget(work_limit);
  std::string out;
  Renderer(globals).render(nodes, out);
  return out;
}

}  // namespace msa::jinja
