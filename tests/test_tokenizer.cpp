// Unit tests of the tokenizer (hand-built tokenizer.json files) and of the chat-template
// interpreter. Parity with Hugging Face `tokenizers` on trained tokenizers and a varied
// corpus is tests/parity/tokenizer_parity.py.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "msa/error.h"
#include "msa/tokenizer.h"
#include "test_util.h"
#include "tokenizer/unicode_bytes.h"

namespace {

using json = nlohmann::json;
using msa::testing::expect_error;
using Ids = std::vector<int32_t>;

// The byte-level token of an ASCII string ("a b" -> "aĠb").
std::string bl(std::string_view text) { return msa::tok::bytes_to_byte_level(text); }

// A tokenizer.json: the 256 byte tokens (ids = byte values), then `extra` tokens with ids
// 256, 257, ..., the given merges, a GPT-2 ByteLevel pre-tokenizer and decoder.
json make_tokenizer(const std::vector<std::string>& extra, const json& merges) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[msa::tok::byte_to_char(uint8_t(b))] = b;
  for (size_t i = 0; i < extra.size(); ++i) vocab[extra[i]] = 256 + int(i);
  return {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", json::array()},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model",
       {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
        {"ignore_merges", false}, {"vocab", vocab}, {"merges", merges}}},
  };
}

msa::Tokenizer load(const json& config) { return msa::Tokenizer::from_json_string(config.dump()); }

json added(int id, const std::string& content, bool special) {
  return {{"id", id}, {"content", content}, {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", !special}, {"special", special}};
}

TEST(TokenizerBytes, AlphabetIsABijection) {
  std::set<std::string> seen;
  for (int b = 0; b < 256; ++b) {
    const std::string& ch = msa::tok::byte_to_char(uint8_t(b));
    EXPECT_TRUE(seen.insert(ch).second);
    size_t pos = 0;
    EXPECT_EQ(msa::tok::char_to_byte(msa::tok::next_code_point(ch, pos)), uint8_t(b));
  }
  EXPECT_EQ(msa::tok::byte_to_char(' '), "\xC4\xA0");  // U+0120 'Ġ'
  EXPECT_EQ(msa::tok::byte_to_char('a'), "a");
}

TEST(TokenizerBytes, LossyDecodingReplacesMaximalInvalidSubparts) {
  EXPECT_EQ(msa::tok::utf8_lossy("ok\xC3\xA9"), "ok\xC3\xA9");
  EXPECT_EQ(msa::tok::utf8_lossy("\xE4\xB8"), "\xEF\xBF\xBD");            // truncated 3-byte: one U+FFFD
  EXPECT_EQ(msa::tok::utf8_lossy("\xFF\xFE"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // two invalid leads
  EXPECT_EQ(msa::tok::utf8_lossy("\xE0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong: lead, then stray
  EXPECT_EQ(msa::tok::utf8_lossy("\xF0\x9F\x98x"), "\xEF\xBF\xBDx");
}

TEST(TokenizerBpe, AppliesMergesLowestRankFirst) {
  // "b c" outranks "a b": "abc" -> a + bc.
  auto tok = load(make_tokenizer({"ab", "bc", "abc"}, json::array({json::array({"b", "c"}), json::array({"a", "b"})})));
  EXPECT_EQ(tok.encode("abc"), (Ids{'a', 257}));
  // "a b" first, then "ab c": abc is one token.
  auto tok2 = load(make_tokenizer({"ab", "bc", "abc"}, json::array({"a b", "ab c", "b c"})));
  EXPECT_EQ(tok2.encode("abc"), (Ids{258}));
  EXPECT_EQ(tok2.encode("abcab"), (Ids{258, 256}));
  EXPECT_EQ(tok2.decode(Ids{258, 256}), "abcab");
}

TEST(TokenizerBpe, StringAndListMergesAgree) {
  const std::vector<std::string> extra = {bl(" t"), "he", bl(" the"), "ll", "llo"};
  const json string_merges = json::array({bl(" ") + " t", "h e", bl(" t") + " he", "l l", "ll o"});
  const json list_merges = json::array({json::array({bl(" "), "t"}), json::array({"h", "e"}),
                                        json::array({bl(" t"), "he"}), json::array({"l", "l"}),
                                        json::array({"ll", "o"})});
  auto a = load(make_tokenizer(extra, string_merges));
  auto b = load(make_tokenizer(extra, list_merges));
  const std::string text = "hello the other hello";
  EXPECT_EQ(a.encode(text), b.encode(text));
  EXPECT_EQ(a.decode(a.encode(text)), text);
  // " the" is one word of the GPT-2 split and merges to one token.
  EXPECT_EQ(a.encode(" the"), (Ids{258}));
  EXPECT_EQ(a.encode("hello"), (Ids{257, 260}));
}

TEST(TokenizerBpe, IgnoreMergesTakesWholeWordsFromTheVocabulary) {
  // "abc" is in the vocabulary but no merge builds it.
  json config = make_tokenizer({"abc"}, json::array());
  EXPECT_EQ(load(config).encode("abc"), (Ids{'a', 'b', 'c'}));
  config["model"]["ignore_merges"] = true;
  EXPECT_EQ(load(config).encode("abc"), (Ids{256}));
}

TEST(TokenizerBpe, MissingCharactersUseUnkOrAreDropped) {
  json config = make_tokenizer({"<unk>"}, json::array());
  config["model"]["vocab"].erase("z");
  EXPECT_EQ(load(config).encode("azza"), (Ids{'a', 'a'}));
  config["model"]["unk_token"] = "<unk>";
  EXPECT_EQ(load(config).encode("azza"), (Ids{'a', 256, 256, 'a'}));
  config["model"]["fuse_unk"] = true;
  EXPECT_EQ(load(config).encode("azza"), (Ids{'a', 256, 'a'}));
}

TEST(TokenizerAddedTokens, MatchLongestFirstBeforePreTokenization) {
  json config = make_tokenizer({}, json::array());
  config["added_tokens"] = json::array({added(300, "]~b]", true), added(301, "]~b]ai", true),
                                        added(302, "[e~[", true), added(303, "<think>", false)});
  auto tok = load(config);
  EXPECT_EQ(tok.encode("]~b]ai\nx[e~["), (Ids{301, '\n', 'x', 302}));
  EXPECT_EQ(tok.encode("]~b]user"), (Ids{300, 'u', 's', 'e', 'r'}));
  EXPECT_EQ(tok.encode("a<think>b"), (Ids{'a', 303, 'b'}));
  EXPECT_EQ(tok.encode("]~b"), (Ids{']', '~', 'b'}));
  EXPECT_EQ(tok.decode(Ids{301, 'h', 'i', 302}), "]~b]ai" "hi" "[e~[");
  EXPECT_EQ(tok.decode(Ids{301, 'h', 'i', 302, 303}, /*skip_special_tokens=*/true), "hi<think>");
  EXPECT_EQ(tok.token_to_id("]~b]ai"), 301);
  EXPECT_EQ(tok.token_to_id(bl(" ")), 32);
  EXPECT_FALSE(tok.token_to_id("nope").has_value());
  EXPECT_EQ(tok.id_to_token(302), "[e~[");
  EXPECT_TRUE(tok.is_special(300));
  EXPECT_FALSE(tok.is_special(303));
  EXPECT_EQ(tok.vocab_size(), 304u);
  expect_error([&] { tok.id_to_token(999); }, "argument 'id'");
  expect_error([&] { tok.decode(Ids{999}); }, "argument 'ids'");
}

TEST(TokenizerAddedTokens, LstripAndRstripTakeTheSurroundingSpaces) {
  json config = make_tokenizer({}, json::array());
  json mask = added(300, "<mask>", true);
  mask["lstrip"] = true;
  mask["rstrip"] = true;
  config["added_tokens"] = json::array({mask});
  EXPECT_EQ(load(config).encode("a  <mask>  b"), (Ids{'a', 300, 'b'}));
}

TEST(TokenizerPipeline, SplitRegexThenByteLevel) {
  json config = make_tokenizer({}, json::array());
  config["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array({{{"type", "Split"}, {"pattern", {{"Regex", R"(\p{N}{1,3}|\s+(?!\S)|\s+|\p{L}+|[^\s\p{L}\p{N}]+)"}}},
                     {"behavior", "Isolated"}, {"invert", false}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", false}, {"use_regex", false}}})}};
  config["model"]["vocab"]["12"] = 256;
  config["model"]["vocab"]["123"] = 257;
  config["model"]["vocab"]["34"] = 258;
  config["model"]["merges"] = json::array({"1 2", "12 3", "3 4"});
  // Digits split in runs of three: "1234" -> "123" "4"; "12345" -> "123" "45".
  auto tok = load(config);
  EXPECT_EQ(tok.encode("1234"), (Ids{257, '4'}));
  EXPECT_EQ(tok.encode("34 1234"), (Ids{258, 32, 257, '4'}));
  EXPECT_EQ(tok.decode(tok.encode("x  \u00e9\u4e2d 12")), "x  \u00e9\u4e2d 12");
}

TEST(TokenizerPipeline, NfcAndBosPostProcessor) {
  json config = make_tokenizer({}, json::array());
  config["normalizer"] = {{"type", "NFC"}};
  config["added_tokens"] = json::array({added(300, "]~!b[", true)});
  config["post_processor"] = {{"type", "TemplateProcessing"},
                              {"single", json::array({{{"SpecialToken", {{"id", "]~!b["}, {"type_id", 0}}}},
                                                      {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
                              {"pair", nullptr},
                              {"special_tokens", {{"]~!b[", {{"id", "]~!b["}, {"ids", {300}}, {"tokens", {"]~!b["}}}}}}};
  auto tok = load(config);
  const Ids composed = tok.encode("\u00e9");
  EXPECT_EQ(composed, (Ids{0xC3, 0xA9}));
  EXPECT_EQ(tok.encode("e\u0301"), composed);  // NFC composes e + U+0301
  EXPECT_EQ(tok.encode("x", true), (Ids{300, 'x'}));
  expect_error([&] { tok.encode("\xFF"); }, "UTF-8");
}

TEST(TokenizerErrors, NameTheOffendingField) {
  expect_error([] { msa::Tokenizer::from_json_string("{\"model\": "); }, "invalid JSON");
  expect_error([] { msa::Tokenizer::from_file("/nonexistent/tokenizer.json"); }, "cannot open");
  auto with = [](const char* path, json value) {
    json config = make_tokenizer({"ab"}, json::array({"a b"}));
    config[json::json_pointer(path)] = value;
    return [config] { load(config); };
  };
  expect_error(with("/model/type", "WordPiece"), "model.type");
  expect_error(with("/model/byte_fallback", true), "model.byte_fallback");
  expect_error(with("/model/dropout", 0.1), "model.dropout");
  expect_error(with("/model/merges/0", "a c"), "model.merges");
  expect_error(with("/model/merges/0", "abc"), "model.merges[0]");
  expect_error(with("/model/merges/0", 7), "model.merges[0]");
  expect_error(with("/model/vocab", json::array()), "model.vocab");
  expect_error(with("/model/surprise", 1), "model.surprise");
  expect_error(with("/truncation", json::object()), "truncation");
  expect_error(with("/normalizer", {{"type", "Lowercase"}}), "normalizer.type");
  expect_error(with("/decoder", {{"type", "WordPiece"}}), "decoder.type");
  expect_error(with("/post_processor", {{"type", "BertProcessing"}}), "post_processor.type");
  expect_error(with("/pre_tokenizer", {{"type", "Whitespace"}}), "pre_tokenizer.type");
  expect_error(with("/pre_tokenizer", {{"type", "Split"}, {"pattern", {{"Regex", "(("}}}, {"behavior", "Isolated"}}),
               "pre_tokenizer.pattern");
  expect_error(with("/pre_tokenizer", {{"type", "Split"}, {"pattern", {{"Regex", "a"}}}, {"behavior", "Contiguous"}}),
               "pre_tokenizer.behavior");
  expect_error(with("/added_tokens", json::array({{{"id", 5}}})), "added_tokens[0].content");
}

TEST(TokenizerModelDir, ReadsChatTemplateAndSpecialTokens) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("msa_tok_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "tokenizer.json") << make_tokenizer({}, json::array()).dump();
  std::ofstream(dir / "tokenizer_config.json")
      << json{{"bos_token", {{"content", "<s>"}}}, {"eos_token", "</s>"},
              {"chat_template", "{{ bos_token }}{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                                "{% if add_generation_prompt %}[ai]{% endif %}{{ eos_token }}"}}
             .dump();
  auto tok = msa::Tokenizer::from_model_dir(dir.string());
  ASSERT_TRUE(tok.has_chat_template());
  const std::vector<msa::ChatMessage> messages = {{"user", "hi"}, {"assistant", "yo"}};
  EXPECT_EQ(tok.apply_chat_template(messages, true), "<s>[user]hi[assistant]yo[ai]</s>");
  // chat_template.jinja takes precedence.
  std::ofstream(dir / "chat_template.jinja") << "{{ messages | length }}";
  EXPECT_EQ(msa::Tokenizer::from_model_dir(dir.string()).apply_chat_template(messages, false), "2");
  fs::remove_all(dir);
  expect_error([&] { load(make_tokenizer({}, json::array())).apply_chat_template(messages, true); },
               "no chat template");
}

std::string render(const std::string& source, const json& context) {
  return msa::ChatTemplate::from_string(source).render_json(context.dump());
}

TEST(ChatTemplate, RendersTheJinjaSubset) {
  const json ctx = {{"messages", json::array({{{"role", "system"}, {"content", " sys "}},
                                              {{"role", "user"}, {"content", "hi"}}})},
                    {"n", 3}};
  EXPECT_EQ(render("{% for m in messages %}{{ loop.index0 }}{{ m['role'] }}:{{ m.content | trim }}"
                   "{% if not loop.last %}|{% endif %}{% endfor %}", ctx),
            "0system:sys|1user:hi");
  EXPECT_EQ(render("{% if n > 5 %}big{% elif n == 3 %}three{% else %}small{% endif %}", ctx), "three");
  EXPECT_EQ(render("{% set x = 'a' ~ n + 'b' %}{{ x }}", json{{"n", 1}}), "a1b");  // ~ binds tighter than +
  EXPECT_EQ(render("{{ 'user' in ['user', 'ai'] and 'x' not in 'abc' or false }}", ctx), "True");
  EXPECT_EQ(render("{{ messages | length }} {{ messages[-1].content }} {{ missing is defined }}", ctx), "2 hi False");
  EXPECT_EQ(render("{{ {'b': 1, 'a': [true, none, 'q\"']} | tojson }}", ctx), R"({"b": 1, "a": [true, null, "q\""]})");
  EXPECT_EQ(render("{%- set ns = namespace(k=0) -%}{% for i in range(4) %}{% set ns.k = ns.k + i %}{% endfor %}{{ ns.k }}", ctx),
            "6");
  EXPECT_EQ(render("{{ 'a</think>b'.split('</think>')[-1] }}{{ 'xyz'[1:] }}{{ [1,2,3][::-1] }}", ctx), "byz[3, 2, 1]");
}

TEST(ChatTemplate, WhitespaceControlTrimAndLstripBlocks) {
  // trim_blocks drops the newline after a block tag, lstrip_blocks the indentation before it.
  EXPECT_EQ(render("a\n  {% if true %}\nb\n  {% endif %}\nc", json::object()), "a\nb\nc");
  EXPECT_EQ(render("a  {{- ' b ' -}}  c", json::object()), "a b c");
  EXPECT_EQ(render("x {#- comment -#} y", json::object()), "xy");
}

TEST(ChatTemplate, ErrorsAreMsaErrors) {
  expect_error([] { render("{{ raise_exception('bad role') }}", json::object()); }, "bad role");
  expect_error([] { msa::ChatTemplate::from_string("line\n{% if x %}"); }, "endif");
  expect_error([] { msa::ChatTemplate::from_string("{% macro f() %}{% endmacro %}"); }, "macro");
  expect_error([] { msa::ChatTemplate::from_string("{{ a + }}"); }, "line 1");
  expect_error([] { render("{{ x.y }}", json::object()); }, "'x' is undefined");
  expect_error([] { render("{{ 1 | nosuchfilter }}", json::object()); }, "nosuchfilter");
  // Builtins handed the wrong type: a clear msa::Error naming the types (a
  // std::bad_variant_access would escape the server's error handling as a crash).
  expect_error([] { render("{{ 'a,b,c'.split(5) }}", json::object()); },
               "split() separator: expected a string or none, got int");
  expect_error([] { render("{{ 'a,b,c'.split(sep=[1]) }}", json::object()); }, "got list");
}

}  // namespace
