// MiniMax-M3's reasoning and tool-call output, split into OpenAI's fields the way vLLM's M3
// parsers split them (vllm/reasoning/minimax_m3_reasoning_parser.py and the M3 text parser
// behind vllm/tool_parsers/minimax_m3_tool_parser.py), as `reasoning_content` and
// `tool_calls`:
//
//   <mm:think>reasoning</mm:think>answer]<]minimax[>[<tool_call>
//   ]<]minimax[>[<invoke name="get_weather">]<]minimax[>[<city>Paris]<]minimax[>[</city>]<]minimax[>[</invoke>
//   ]<]minimax[>[</tool_call>
//
// Every tag of a tool call carries the namespace token `]<]minimax[>[`; a parameter is named
// by its tag, nested tags are objects and `<item>` children arrays. The chat template may
// prefill the reasoning opener (M3's thinking_mode), so the text can start inside reasoning:
// the server tells the parser when the rendered prompt ends with the opener.
//
// Which markers a model uses is read from its tokenizer (OutputFormat::detect): a format
// whose marker tokens the vocabulary lacks is off, and its text stays plain content (the
// models `msa make-model` writes have neither). The special ids some tables give for M3
// (<think> 200050, </think> 200051) could not be checked against the released tokenizer
// here; the parser keys on the token strings, so it does not depend on them.
//
// Streaming: feed() takes text as it is decoded and returns what is settled; a tail that
// may still become a marker is held back until it is decided. A tool call is returned whole
// when its invoke closes (clients join argument pieces; one piece is valid).
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace msa {
class Tokenizer;
}

namespace msa::serve {

struct OutputFormat {
  std::string reasoning_start, reasoning_end;  // "" when the model has no reasoning markers
  std::string tool_namespace;                  // "]<]minimax[>[" when it has M3 tool calls

  bool has_reasoning() const { return !reasoning_start.empty(); }
  bool has_tools() const { return !tool_namespace.empty(); }
  // The markers the tokenizer holds as tokens: <mm:think> (M3, vLLM's parser) or <think>,
  // and M3's tool-call namespace token.
  static OutputFormat detect(const Tokenizer& tokenizer);
};

struct ToolCall {
  std::string id, name, arguments;  // arguments: a JSON object's text
};

struct ParsedText {
  std::string content, reasoning;
  std::vector<ToolCall> tool_calls;
  bool empty() const { return content.empty() && reasoning.empty() && tool_calls.empty(); }
  void append(ParsedText more);
};

class OutputParser {
 public:
  // tools: the request's tools (null: tool calls stay content); their parameter schemas
  // type the arguments (a "string" parameter stays text; numbers, booleans, objects and
  // arrays are read as JSON when they parse).
  OutputParser(OutputFormat format, bool start_in_reasoning, const nlohmann::ordered_json& tools,
               std::string call_id_prefix);

  ParsedText feed(std::string_view text);
  ParsedText finish();  // the rest, at the end of the output
  int tool_calls() const { return calls_; }

 private:
  enum class Mode { content, reasoning, tool_block };
  void run(ParsedText& out, bool at_end);
  bool parse_invoke(std::string_view invoke, ParsedText& out);
  nlohmann::ordered_json typed_value(const std::string& function, const std::vector<std::string>& path,
                                     const std::string& text) const;

  OutputFormat format_;
  nlohmann::ordered_json tools_;
  std::string call_id_prefix_;
  Mode mode_ = Mode::content;
  bool at_start_ = true;
  std::string pending_;
  int calls_ = 0;
};

}  // namespace msa::serve
