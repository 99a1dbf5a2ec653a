// `msa serve` below HTTP: the prefix cache and the engine's cancel and prefix reuse, the
// request parser's refusals, M3's reasoning / tool-call splitting and the text stream's stop
// strings. The protocol and load tests over HTTP are tests/serve/*.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "api_error.h"
#include "cli_runner.h"
#include "model/prefix_cache.h"
#include "msa/model.h"
#include "msa/model_engine.h"
#include "msa/model_random.h"
#include "msa/parallel_group.h"
#include "output_parser.h"
#include "request_parse.h"
#include "scheduler.h"
#include "test_util.h"
#include "text_stream.h"
#ifdef MSA_WITH_TOKENIZER
#include "msa/tokenizer.h"
#endif

namespace msa {
namespace {

namespace fs = std::filesystem;
using serve::OrderedJson;

// ---- prefix cache ----

std::vector<int32_t> iota_tokens(int n, int start = 0) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (int i = 0; i < n; ++i) t[static_cast<size_t>(i)] = start + i;
  return t;
}

TEST(ServePrefixCache, ChainsAreSharedAndEvictedLeavesFirst) {
  PrefixCache cache(4);
  const std::vector<int32_t> a = iota_tokens(10);          // blocks [0..3], [4..7], rest partial
  cache.insert(a, std::vector<int32_t>{7, 8, 9}, 2);       // a request held pages 7, 8, 9
  EXPECT_EQ(cache.cached_pages(), 2);
  EXPECT_EQ(cache.evictable_pages(), 0);                   // still held by it
  EXPECT_EQ(cache.release(std::vector<int32_t>{7, 8, 9}), std::vector<int32_t>{9});
  EXPECT_EQ(cache.evictable_pages(), 2);
  // A prompt with the same first block, another second block: one page shared.
  std::vector<int32_t> b = iota_tokens(10);
  b[5] = 99;
  EXPECT_EQ(cache.acquire(b, 9), std::vector<int32_t>{7});
  EXPECT_EQ(cache.acquire(a, 9), (std::vector<int32_t>{7, 8}));
  EXPECT_EQ(cache.acquire(a, 7), std::vector<int32_t>{7});  // whole blocks within the limit only
  EXPECT_EQ(cache.evictable_pages(), 0);
  cache.release(std::vector<int32_t>{7});
  cache.release(std::vector<int32_t>{7, 8});
  cache.release(std::vector<int32_t>{7});
  // The leaf goes first, then its parent.
  EXPECT_EQ(cache.evict(1), std::vector<int32_t>{8});
  EXPECT_EQ(cache.evict(5), std::vector<int32_t>{7});
  EXPECT_EQ(cache.cached_pages(), 0);
}

TEST(ServePrefixCache, ADuplicateBlockEndsTheRegistration) {
  PrefixCache cache(2);
  const std::vector<int32_t> t = iota_tokens(6);
  cache.insert(t, std::vector<int32_t>{1, 2, 3}, 3);
  cache.insert(t, std::vector<int32_t>{4, 5, 6}, 3);  // the same blocks in other pages
  EXPECT_EQ(cache.cached_pages(), 3);
  EXPECT_EQ(cache.release(std::vector<int32_t>{4, 5, 6}), (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(cache.release(std::vector<int32_t>{1, 2, 3}), std::vector<int32_t>{});
  EXPECT_EQ(cache.evictable_pages(), 3);
}

// ---- engine: cancel and prefix reuse ----

const Model& tiny_model() {
  static const Model model = [] {
    const fs::path dir = testing::fresh_dir("serve_tiny");
    write_random_checkpoint(model_config_preset("tiny"), dir.string(), {.seed = 3, .dtype = DType::f32});
    return Model::load(dir.string());
  }();
  return model;
}

std::vector<int32_t> tokens(int64_t n, int32_t salt) {
  std::vector<int32_t> t;
  for (int64_t i = 0; i < n; ++i) t.push_back(static_cast<int32_t>((i * 37 + salt * 11 + 5) % 509 + 3));
  return t;
}

std::map<int64_t, std::vector<int32_t>> run_all(Engine& engine, std::map<int64_t, int64_t>* cached = nullptr) {
  std::map<int64_t, std::vector<int32_t>> out;
  while (!engine.idle())
    for (const TokenEvent& e : engine.step()) {
      out[e.request].push_back(e.token);
      if (cached) (*cached)[e.request] = e.cached_tokens;
    }
  return out;
}

TEST(ServeEngine, PrefixReuseGivesTheSameTokensAndFreesEveryPage) {
  const std::vector<int32_t> system = tokens(70, 1);  // 4 whole pages of 16, then 6 tokens
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 4; ++i) {
    std::vector<int32_t> prompt = system;
    const std::vector<int32_t> own = tokens(10 + 7 * i, 10 + i);
    prompt.insert(prompt.end(), own.begin(), own.end());
    requests.push_back({.prompt = prompt, .max_tokens = 6});
  }
  std::vector<std::vector<int32_t>> alone;
  for (const GenerationRequest& r : requests) {
    Engine engine(tiny_model(), {.cache_tokens = 1024});
    engine.submit(r);
    alone.push_back(run_all(engine).begin()->second);
  }
  Engine engine(tiny_model(), {.cache_tokens = 1024, .prefill_chunk = 32, .prefix_caching = true});
  engine.submit(requests[0]);
  std::map<int64_t, int64_t> cached;
  auto first = run_all(engine, &cached);
  EXPECT_EQ(first[0], alone[0]);
  EXPECT_EQ(cached[0], 0);
  for (size_t i = 1; i < requests.size(); ++i) engine.submit(requests[i]);
  auto rest = run_all(engine, &cached);
  for (size_t i = 1; i < requests.size(); ++i) {
    EXPECT_EQ(rest[static_cast<int64_t>(i)], alone[i]) << "request " << i;
    EXPECT_EQ(cached[static_cast<int64_t>(i)], 64) << "request " << i;  // the 4 whole pages
  }
  const CachePages pages = engine.pages();
  EXPECT_EQ(pages.used, 0);
  EXPECT_GT(pages.cached, 0);
  EXPECT_EQ(pages.free + pages.cached, pages.total);
}

TEST(ServeEngine, CancelFreesPagesAtOnceAndMaxRunningBoundsTheBatch) {
  Engine engine(tiny_model(), {.cache_tokens = 512, .max_running = 2, .prefix_caching = true});
  const int64_t a = engine.submit({.prompt = tokens(40, 1), .max_tokens = 100});
  const int64_t b = engine.submit({.prompt = tokens(40, 2), .max_tokens = 100});
  const int64_t c = engine.submit({.prompt = tokens(40, 3), .max_tokens = 100});
  EXPECT_EQ(engine.running(), 2);
  EXPECT_EQ(engine.waiting(), 1);
  engine.step();
  EXPECT_GT(engine.pages().used, 0);
  EXPECT_TRUE(engine.cancel(c));  // waiting
  EXPECT_TRUE(engine.cancel(a));  // running
  EXPECT_FALSE(engine.cancel(a));
  EXPECT_EQ(engine.running(), 1);
  EXPECT_TRUE(engine.cancel(b));
  EXPECT_TRUE(engine.idle());
  EXPECT_EQ(engine.pages().used, 0);
}

// ---- --tp: the scheduler over in-process tensor-parallel ranks ----

const fs::path& tiny_tp_dir() { return testing::made_model_dir("serve_tiny_tp", "tiny-tp", 5, DType::f32); }

// Waits (at most a minute) for the job's end; returns the last update.
serve::Job::Update wait_finished(serve::Job& job) {
  serve::Job::Update update;
  for (int i = 0; i < 600 && !update.finished; ++i) update = job.wait(std::chrono::milliseconds(100));
  return update;
}

TEST(ServeParallel, ARankFailingMidStepEndsTheRequestsWithAnErrorAndTheServerAnswersOn) {
  LocalParallelGroup group(tiny_tp_dir().string(), 2,
                           {.threads_per_rank = 1, .before_rank_forward = [](int rank, int64_t step) {
                              if (rank == 1 && step == 1) throw std::runtime_error("injected failure");
                            }});
  serve::Metrics metrics;
  serve::SchedulerOptions options;
  options.engine = {.cache_tokens = 256, .prefill_chunk = 8, .max_running = 4};
  serve::Scheduler scheduler(group, nullptr, options, metrics, {});
  const std::shared_ptr<serve::Job> job = scheduler.submit({.prompt = tokens(20, 1), .max_tokens = 4}, {});
  const serve::Job::Update update = wait_finished(*job);
  ASSERT_TRUE(update.finished);
  EXPECT_EQ(update.finish_reason, "error");
  EXPECT_NE(update.error.find("rank 1: injected failure"), std::string::npos) << update.error;
  // Later requests fail at once with the same cause rather than waiting.
  const std::shared_ptr<serve::Job> next = scheduler.submit({.prompt = tokens(5, 2), .max_tokens = 2}, {});
  const serve::Job::Update later = wait_finished(*next);
  EXPECT_EQ(later.finish_reason, "error");
  EXPECT_NE(later.error.find("rank 1: injected failure"), std::string::npos) << later.error;
  scheduler.shutdown();
}

TEST(ServeParallel, TpTheModelCannotTakeAndTpOnCudaAreClearErrors) {
  const std::string model = "serve --model " + testing::shell_quote(tiny_tp_dir().string()) + " --port 0 --threads 1";
  const testing::CliResult three = testing::run_cli(model + " --tp 3");
  EXPECT_NE(three.exit_code, 0);
  EXPECT_NE(three.out.find("config.num_key_value_heads"), std::string::npos) << three.out;
  const testing::CliResult cuda = testing::run_cli(model + " --tp 2 --device cuda");
  EXPECT_NE(cuda.exit_code, 0);
  EXPECT_NE(cuda.out.find("--tp with --device cuda: multi-process CUDA serving is not built yet"), std::string::npos)
      << cuda.out;
}

// ---- request parsing ----

serve::ParseLimits limits() {
  serve::ParseLimits l;
  l.vocab_size = 512;
  l.max_tokens_limit = 1000;
  return l;
}

std::string refusal(serve::Endpoint endpoint, const std::string& body) {
  try {
    serve::parse_request(endpoint, body, limits());
  } catch (const serve::ApiError& e) {
    EXPECT_EQ(e.status, 400);
    return e.param;
  }
  return "accepted";
}

TEST(ServeRequest, ReadsTheFieldsAndNamesTheBadOne) {
  const serve::ParsedRequest r = serve::parse_request(
      serve::Endpoint::chat,
      R"({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 9, "temperature": 0.5,
          "top_p": 0.9, "top_k": -1, "seed": -1, "stop": ["a", "b"], "stop_token_ids": [5],
          "stream": true, "stream_options": {"include_usage": true}, "user": "x",
          "chat_template_kwargs": {"thinking_mode": "enabled"}})",
      limits());
  EXPECT_EQ(r.max_tokens, 9);
  EXPECT_EQ(r.sampling.top_k, 0);
  EXPECT_EQ(r.sampling.seed, ~uint64_t{0});
  EXPECT_EQ(r.stop, (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(r.include_usage);
  const OrderedJson context = serve::chat_template_context(r, "<s>", "</s>");
  EXPECT_EQ(context["thinking_mode"], "enabled");
  EXPECT_EQ(context["bos_token"], "<s>");

  using serve::Endpoint;
  EXPECT_EQ(refusal(Endpoint::completions, R"({"prompt": "x", "max_tokens": 1001})"), "max_tokens");
  EXPECT_EQ(refusal(Endpoint::completions, R"({"prompt": "x", "max_tokens": 0})"), "max_tokens");
  EXPECT_EQ(refusal(Endpoint::completions, R"({"prompt": "x", "top_k": 1.5})"), "top_k");
  EXPECT_EQ(refusal(Endpoint::completions, R"({"prompt": [1, true]})"), "prompt[1]");
  EXPECT_EQ(refusal(Endpoint::completions, R"({"prompt": "x", "stream_options": {"include_usage": true}})"),
            "stream_options");
  EXPECT_EQ(refusal(Endpoint::completions, R"({"prompt": "x", "max_tokens": 5, "max_completion_tokens": 5})"),
            "max_completion_tokens");
  EXPECT_EQ(refusal(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x", "colour": 1}]})"),
            "messages[0].colour");
  EXPECT_EQ(refusal(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": 1}})"),
            "chat_template_kwargs.messages");
  EXPECT_EQ(refusal(Endpoint::chat, R"({"messages": [{"role": "user", "content": "x"}],
                                       "tools": [{"type": "function", "function": {"name": "f"}}]})"),
            "tools");
  EXPECT_EQ(refusal(Endpoint::chat, R"({"messages": [{"role": "assistant", "content": "",
                                        "tool_calls": [{"type": "function", "function": {"arguments": "{}"}}]}]})"),
            "messages[0].tool_calls[0].function.name");
  EXPECT_EQ(refusal(Endpoint::completions, std::string(200, '[')), "");
}

// ---- M3 reasoning and tool calls ----

const std::string kNs = "]<]minimax[>[";

serve::OutputFormat m3_format() {
  return {.reasoning_start = "<mm:think>", .reasoning_end = "</mm:think>", .tool_namespace = kNs};
}

const OrderedJson& weather_tools() {
  static const OrderedJson tools = OrderedJson::parse(R"([{"type": "function", "function": {"name": "get_weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
      "units": {"type": "array", "items": {"type": "string"}}, "opts": {"type": "object",
      "properties": {"metric": {"type": "boolean"}}}}}}}])");
  return tools;
}

serve::ParsedText parse_in_pieces(const std::string& text, size_t piece, bool start_in_reasoning) {
  serve::OutputParser parser(m3_format(), start_in_reasoning, weather_tools(), "call_");
  serve::ParsedText all;
  for (size_t at = 0; at < text.size(); at += piece) all.append(parser.feed(text.substr(at, piece)));
  all.append(parser.finish());
  return all;
}

TEST(ServeOutputParser, SplitsReasoningContentAndToolCallsAtAnyPieceSize) {
  const std::string text = "<mm:think>plan: call it</mm:think>Let me check." + kNs + "<tool_call>\n" + kNs +
                           "<invoke name=\"get_weather\">" + kNs + "<city>Paris" + kNs + "</city>" + kNs +
                           "<days>3" + kNs + "</days>" + kNs + "<units>" + kNs + "<item>C" + kNs + "</item>" + kNs +
                           "<item>F" + kNs + "</item>" + kNs + "</units>" + kNs + "<opts>" + kNs + "<metric>true" +
                           kNs + "</metric>" + kNs + "</opts>" + kNs + "</invoke>\n" + kNs + "<invoke name=\"get_weather\">" +
                           kNs + "<city>Oslo" + kNs + "</city>" + kNs + "</invoke>\n" + kNs + "</tool_call>";
  for (size_t piece : {size_t{1}, size_t{3}, size_t{7}, text.size()}) {
    const serve::ParsedText p = parse_in_pieces(text, piece, false);
    EXPECT_EQ(p.reasoning, "plan: call it") << piece;
    EXPECT_EQ(p.content, "Let me check.") << piece;
    ASSERT_EQ(p.tool_calls.size(), 2u) << piece;
    EXPECT_EQ(p.tool_calls[0].name, "get_weather");
    EXPECT_EQ(p.tool_calls[0].arguments,
              R"({"city":"Paris","days":3,"units":["C","F"],"opts":{"metric":true}})");
    EXPECT_EQ(p.tool_calls[1].arguments, R"({"city":"Oslo"})");
    EXPECT_EQ(p.tool_calls[0].id, "call_0");
    EXPECT_EQ(p.tool_calls[1].id, "call_1");
  }
}

TEST(ServeOutputParser, TemplateOpenedReasoningStrayClosersAndUnfinishedCalls) {
  EXPECT_EQ(parse_in_pieces("thinking...</mm:think>answer", 2, true).reasoning, "thinking...");
  EXPECT_EQ(parse_in_pieces("thinking...</mm:think>answer", 2, true).content, "answer");
  EXPECT_EQ(parse_in_pieces("</mm:think>answer", 1, false).content, "answer");     // a leading stray closer
  EXPECT_EQ(parse_in_pieces("a</mm:think>b", 1, false).content, "a</mm:think>b");  // later ones stay
  EXPECT_EQ(parse_in_pieces("<mm:th", 1, false).content, "<mm:th");                // a marker's start only
  const std::string cut = "x" + kNs + "<tool_call>\n" + kNs + "<invoke name=\"get_weather\">" + kNs + "<city>Pa";
  const serve::ParsedText p = parse_in_pieces(cut, 4, false);
  EXPECT_TRUE(p.tool_calls.empty());
  EXPECT_NE(p.content.find("<city>Pa"), std::string::npos);
  // Without tools in the request, tool-call text is plain content.
  serve::OutputParser plain(m3_format(), false, OrderedJson(), "c");
  serve::ParsedText q = plain.feed(kNs + "<tool_call>x");
  q.append(plain.finish());
  EXPECT_EQ(q.content, kNs + "<tool_call>x");
}

// ---- the text stream ----

#ifdef MSA_WITH_TOKENIZER
TEST(ServeTextStream, StopStringsEndTheTextAcrossTokenBoundaries) {
  const fs::path dir = testing::fresh_dir("serve_tokenizer");
  write_random_tokenizer(model_config_preset("tiny"), dir.string());
  const Tokenizer tokenizer = Tokenizer::from_model_dir(dir.string());
  const std::vector<int32_t> ids = tokenizer.encode("hello brave new world");
  ASSERT_GT(ids.size(), 3u);
  const auto run = [&](std::vector<std::string> stop) {
    serve::TextStream stream(&tokenizer, std::move(stop), {});
    std::string text;
    bool stopped = false;
    for (int32_t id : ids) {
      const serve::TextStream::Piece piece = stream.push(id);
      text += piece.text;
      if (piece.stopped) {
        stopped = true;
        break;
      }
    }
    if (!stopped) text += stream.finish().text;
    return std::make_pair(text, stopped);
  };
  EXPECT_EQ(run({}), std::make_pair(std::string("hello brave new world"), false));
  EXPECT_EQ(run({"ve n"}), std::make_pair(std::string("hello bra"), true));
  EXPECT_EQ(run({"xyz", "o b"}), std::make_pair(std::string("hell"), true));
  EXPECT_EQ(run({"worlds"}), std::make_pair(std::string("hello brave new world"), false));
}
#endif

}  // namespace
}  // namespace msa
