// The reasoning / tool-call splitter of output_parser.h: a small state machine over the
// decoded text (content, reasoning, inside a tool-call block).
#include "output_parser.h"

#include <algorithm>
#include <functional>

#include "core/json_parse.h"
#include "msa/tokenizer.h"

namespace msa::serve {
namespace {

using OrderedJson = nlohmann::ordered_json;

// How many bytes at the end of `text` could be the start of `marker` (held back while
// streaming: the next piece may complete the marker).
size_t partial_marker(std::string_view text, std::string_view marker) {
  for (size_t k = std::min(text.size(), marker.size() - 1); k > 0; --k)
    if (text.substr(text.size() - k) == marker.substr(0, k)) return k;
  return 0;
}

std::string trim_newlines(std::string_view text) {
  while (!text.empty() && (text.front() == '\n' || text.front() == '\r')) text.remove_prefix(1);
  while (!text.empty() && (text.back() == '\n' || text.back() == '\r')) text.remove_suffix(1);
  return std::string(text);
}

struct Element {
  std::string tag, text;
  std::vector<Element> children;
};

}  // namespace

void ParsedText::append(ParsedText more) {
  content += more.content;
  reasoning += more.reasoning;
  for (ToolCall& call : more.tool_calls) tool_calls.push_back(std::move(call));
}

OutputFormat OutputFormat::detect(const Tokenizer& tokenizer) {
  OutputFormat format;
  for (const auto& [start, end] : {std::pair{"<mm:think>", "</mm:think>"}, std::pair{"<think>", "</think>"}})
    if (tokenizer.token_to_id(start) && tokenizer.token_to_id(end)) {
      format.reasoning_start = start;
      format.reasoning_end = end;
      break;
    }
  if (tokenizer.token_to_id("]<]minimax[>[")) format.tool_namespace = "]<]minimax[>[";
  return format;
}

OutputParser::OutputParser(OutputFormat format, bool start_in_reasoning, const OrderedJson& tools,
                           std::string call_id_prefix)
    : format_(std::move(format)), tools_(tools), call_id_prefix_(std::move(call_id_prefix)) {
  if (!format_.has_reasoning()) start_in_reasoning = false;
  if (tools_.is_null() || !tools_.is_array() || tools_.empty()) format_.tool_namespace.clear();
  mode_ = start_in_reasoning ? Mode::reasoning : Mode::content;
  at_start_ = !start_in_reasoning;
}

ParsedText OutputParser::feed(std::string_view text) {
  pending_ += text;
  ParsedText out;
  run(out, false);
  return out;
}

ParsedText OutputParser::finish() {
  ParsedText out;
  run(out, true);
  return out;
}

void OutputParser::run(ParsedText& out, bool at_end) {
  const std::string tool_start = format_.tool_namespace + "<tool_call>";
  const std::string tool_end = format_.tool_namespace + "</tool_call>";
  const std::string invoke_open = format_.tool_namespace + "<invoke name=\"";
  const std::string invoke_close = format_.tool_namespace + "</invoke>";
  for (;;) {
    if (mode_ == Mode::content) {
      if (at_start_ && format_.has_reasoning()) {
        // M3 may open its answer with a stray closer when reasoning is off; drop that one.
        const std::string& closer = format_.reasoning_end;
        if (!at_end && pending_.size() < closer.size() && closer.compare(0, pending_.size(), pending_) == 0)
          return;  // undecided
        if (pending_.compare(0, closer.size(), closer) == 0) pending_.erase(0, closer.size());
      }
      at_start_ = false;
      std::vector<std::string> markers;
      if (format_.has_reasoning()) markers.push_back(format_.reasoning_start);
      if (format_.has_tools()) markers.push_back(tool_start);
      size_t first = std::string::npos, which = 0;
      for (size_t m = 0; m < markers.size(); ++m) {
        const size_t at = pending_.find(markers[m]);
        if (at < first) first = at, which = m;
      }
      if (first != std::string::npos) {
        out.content += pending_.substr(0, first);
        pending_.erase(0, first + markers[which].size());
        mode_ = markers[which] == tool_start ? Mode::tool_block : Mode::reasoning;
        continue;
      }
      size_t keep = 0;
      if (!at_end)
        for (const std::string& marker : markers) keep = std::max(keep, partial_marker(pending_, marker));
      out.content += pending_.substr(0, pending_.size() - keep);
      pending_.erase(0, pending_.size() - keep);
      return;
    }
    if (mode_ == Mode::reasoning) {
      const size_t end = pending_.find(format_.reasoning_end);
      if (end != std::string::npos) {
        out.reasoning += pending_.substr(0, end);
        pending_.erase(0, end + format_.reasoning_end.size());
        mode_ = Mode::content;
        continue;
      }
      const size_t keep = at_end ? 0 : partial_marker(pending_, format_.reasoning_end);
      out.reasoning += pending_.substr(0, pending_.size() - keep);
      pending_.erase(0, pending_.size() - keep);
      return;
    }
    // Inside a tool-call block: every complete invoke becomes a call.
    for (;;) {
      const size_t open = pending_.find(invoke_open);
      const size_t block_end = pending_.find(tool_end);
      if (open == std::string::npos || (block_end != std::string::npos && block_end < open)) break;
      const size_t close = pending_.find(invoke_close, open);
      if (close == std::string::npos) break;
      const size_t stop = close + invoke_close.size();
      if (!parse_invoke(std::string_view(pending_).substr(open, stop - open), out))
        out.content += pending_.substr(open, stop - open);  // not a call after all: keep the text
      pending_.erase(0, stop);
    }
    const size_t block_end = pending_.find(tool_end);
    if (block_end != std::string::npos) {
      pending_.erase(0, block_end + tool_end.size());
      mode_ = Mode::content;
      continue;
    }
    if (at_end) {  // an unfinished call: its text is content, not a call
      if (pending_.find_first_not_of(" \t\r\n") != std::string::npos) out.content += pending_;
      pending_.clear();
    }
    return;
  }
}

bool OutputParser::parse_invoke(std::string_view invoke, ParsedText& out) {
  const std::string& ns = format_.tool_namespace;
  const std::string_view head = "<invoke name=\"";
  invoke.remove_prefix(ns.size() + head.size());
  const size_t name_end = invoke.find("\">");
  if (name_end == std::string_view::npos) return false;
  const std::string name(invoke.substr(0, name_end));
  if (name.empty()) return false;
  std::string_view body = invoke.substr(name_end + 2);
  body.remove_suffix(ns.size() + std::string_view("</invoke>").size());

  // The parameters: split at the namespace token; "<tag>text" opens, "</tag>" closes.
  std::vector<Element> stack(1);
  size_t at = body.find(ns);
  while (at != std::string_view::npos) {
    const size_t next = body.find(ns, at + ns.size());
    const std::string_view chunk = body.substr(at + ns.size(), next == std::string_view::npos ? next : next - at - ns.size());
    at = next;
    if (chunk.substr(0, 2) == "</") {
      const size_t gt = chunk.find('>');
      const std::string tag(chunk.substr(2, gt == std::string_view::npos ? gt : gt - 2));
      // Close up to the matching open tag (tolerating a missing closer in between).
      bool open = false;
      for (size_t i = 1; i < stack.size(); ++i) open = open || stack[i].tag == tag;
      while (open && stack.size() > 1) {
        Element done = std::move(stack.back());
        stack.pop_back();
        const bool matched = done.tag == tag;
        stack.back().children.push_back(std::move(done));
        if (matched) break;
      }
    } else if (chunk.substr(0, 1) == "<") {
      const size_t gt = chunk.find('>');
      Element element;
      element.tag = std::string(chunk.substr(1, gt == std::string_view::npos ? gt : gt - 1));
      if (gt != std::string_view::npos) element.text = std::string(chunk.substr(gt + 1));
      if (stack.size() >= 64) return false;  // deeper than any real call
      stack.push_back(std::move(element));
    } else {
      stack.back().text += chunk;
    }
  }
  while (stack.size() > 1) {
    Element done = std::move(stack.back());
    stack.pop_back();
    stack.back().children.push_back(std::move(done));
  }

  std::vector<std::string> path;
  const std::function<OrderedJson(const Element&)> to_json = [&](const Element& e) -> OrderedJson {
    if (e.children.empty()) return typed_value(name, path, trim_newlines(e.text));
    const bool list = std::all_of(e.children.begin(), e.children.end(),
                                  [](const Element& c) { return c.tag == "item"; });
    OrderedJson value = list ? OrderedJson::array() : OrderedJson::object();
    for (const Element& child : e.children) {
      path.push_back(child.tag);
      if (list) value.push_back(to_json(child));
      else value[child.tag] = to_json(child);
      path.pop_back();
    }
    return value;
  };
  OrderedJson arguments = OrderedJson::object();
  for (const Element& parameter : stack[0].children) {
    path = {parameter.tag};
    arguments[parameter.tag] = to_json(parameter);
  }
  out.tool_calls.push_back({.id = call_id_prefix_ + std::to_string(calls_++),
                            .name = name,
                            .arguments = arguments.dump(-1, ' ', false, OrderedJson::error_handler_t::replace)});
  return true;
}

OrderedJson OutputParser::typed_value(const std::string& function, const std::vector<std::string>& path,
                                      const std::string& text) const {
  // The parameter's schema: tools[i].function.parameters, then properties / items per level.
  const OrderedJson* schema = nullptr;
  for (const OrderedJson& tool : tools_)
    if (tool.is_object() && tool.contains("function") && tool["function"].is_object() &&
        tool["function"].value("name", "") == function && tool["function"].contains("parameters")) {
      schema = &tool["function"]["parameters"];
      break;
    }
  for (const std::string& step : path) {
    if (!schema || !schema->is_object()) return text;
    if (step == "item" && schema->contains("items")) schema = &(*schema)["items"];
    else if (schema->contains("properties") && (*schema)["properties"].is_object() &&
             (*schema)["properties"].contains(step))
      schema = &(*schema)["properties"][step];
    else return text;
  }
  if (!schema || !schema->is_object() || !schema->contains("type")) return text;
  const OrderedJson& type = (*schema)["type"];
  const auto allows = [&](const char* t) {
    return (type.is_string() && type.get<std::string>() == t) ||
           (type.is_array() && std::find(type.begin(), type.end(), t) != type.end());
  };
  if (allows("string") && !(type.is_array() && type.size() > 1)) return text;
  try {
    OrderedJson value = parse_ordered_json_limited(text, 32);
    if ((value.is_number() && (allows("number") || allows("integer"))) ||
        (value.is_boolean() && allows("boolean")) || (value.is_object() && allows("object")) ||
        (value.is_array() && allows("array")) || (value.is_null() && allows("null")))
      return value;
  } catch (const Error&) {
  }
  return text;
}

}  // namespace msa::serve
