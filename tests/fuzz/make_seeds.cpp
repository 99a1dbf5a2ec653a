// Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/<target>/): valid inputs of
// every kind each reader takes, and the known-bad inputs of the hardening issue. The seeds
// are committed; this program regenerates them (fixed seeds, same bytes every run):
//   build-asan/tests/fuzz/fuzz_make_seeds tests/fuzz/corpus
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "msa/model_config.h"
#include "msa/ops.h"
#include "msa/safetensors.h"
#include "msa/training.h"
#include "op_command.h"
#include "released_config.h"
#ifdef MSA_SEEDS_WITH_IMAGES
#include "vision_media_files.h"
#endif

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using msa::Tensor;
using Named = std::vector<std::pair<std::string, Tensor>>;

fs::path root;

void write(const std::string& target, const std::string& name, const std::string& bytes) {
  fs::create_directories(root / target);
  std::ofstream out(root / target / name, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::string safetensors_bytes(const Named& tensors, const std::map<std::string, std::string>& metadata = {}) {
  const fs::path path = root / "tmp.safetensors";
  msa::save_safetensors(path.string(), tensors, metadata);
  std::string bytes = read(path);
  fs::remove(path);
  return bytes;
}

std::string raw_safetensors(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(uint64_t(header.size()) >> (8 * i));
  return out + header + std::string(data_bytes, '\x3f');
}

std::mt19937_64 rng{20261130};

Tensor normal(const msa::Shape& shape) {
  Tensor t = Tensor::zeros(shape, msa::DType::f32);
  std::normal_distribution<float> dist(0, 1);
  for (float& x : t.span<float>()) x = dist(rng);
  return t;
}

Tensor ints(const std::vector<int32_t>& values) {
  return Tensor::from_vector(values, {static_cast<int64_t>(values.size())});
}

// ---- safetensors ----
void safetensors_seeds() {
  const std::string t = "fuzz_safetensors";
  Named tensors = {{"a", normal({2, 3})},
                   {"b", normal({4}).to(msa::DType::bf16)},
                   {"c", normal({2, 2}).to(msa::DType::f16)},
                   {"d", normal({3}).to(msa::DType::e4m3)},
                   {"e", ints({1, 2, 3})},
                   {"f", Tensor::zeros({0, 2}, msa::DType::f64)},
                   {"g", Tensor::zeros({}, msa::DType::u8)}};
  write(t, "valid_single", safetensors_bytes(tensors, {{"format", "pt"}}));
  const std::string shard = safetensors_bytes({{"w", normal({2, 2})}, {"v", ints({7})}});
  const json index = {{"metadata", {{"total_size", 20}}}, {"weight_map", {{"w", "a.safetensors"}, {"v", "a.safetensors"}}}};
  write(t, "valid_sharded", index.dump() + "\n--shard--\n" + shard);
  // Known-bad: nesting past the limit (the SIGSEGV of the issue), a truncated file, offsets
  // past the end, overlapping tensors, an absurd header length, a shard path escape, a
  // weight map pointing at a missing tensor.
  write(t, "bad_deep_header", raw_safetensors(std::string(200, '[') + std::string(200, ']'), 0));
  write(t, "bad_deep_in_entry",
        raw_safetensors("{\"x\": " + std::string(200, '[') + std::string(200, ']') + "}", 0));
  const std::string valid = safetensors_bytes({{"a", normal({4})}});
  write(t, "bad_truncated", valid.substr(0, valid.size() - 3));
  write(t, "bad_offsets",
        raw_safetensors(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,64]}})", 16));
  write(t, "bad_overlap", raw_safetensors(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12));
  write(t, "bad_header_length", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}");
  write(t, "bad_shape", raw_safetensors(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0));
  write(t, "bad_shard_escape", json({{"weight_map", {{"w", "../a.safetensors"}}}}).dump() + "\n--shard--\n" + shard);
  write(t, "bad_shard_missing_tensor", json({{"weight_map", {{"zz", "a.safetensors"}}}}).dump() + "\n--shard--\n" + shard);
  write(t, "bad_deep_index", std::string(200, '[') + "\n--shard--\n" + shard);
}

// ---- config.json ----
void config_seeds() {
  const std::string t = "fuzz_config";
  for (const std::string& name : msa::model_config_preset_names())
    write(t, "valid_preset_" + name, msa::model_config_to_json(msa::model_config_preset(name)));
  msa::ModelConfig quantized = msa::model_config_preset("tiny");
  quantized.quantization = "nvfp4";  // with ModelOpt's quantization_config block
  write(t, "valid_quantized_nvfp4", msa::model_config_to_json(quantized));
  const json released = json::parse(kReleasedConfigJson);
  write(t, "valid_released", released.dump(1));
  write(t, "valid_transformers", R"({"text_config": {
      "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 64,
      "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
      "layer_types": ["full_attention", "minimax_m3_sparse"], "mlp_layer_types": ["dense", "sparse"],
      "index_n_heads": 2, "index_head_dim": 16, "index_block_size": 16, "index_topk_blocks": 4,
      "intermediate_size": 8, "dense_intermediate_size": 8, "num_local_experts": 4,
      "num_experts_per_tok": 2}})");
  // The issue's configs that ran although they cannot be right.
  const auto bad = [&](const std::string& name, const std::string& pointer, const json& value) {
    json edited = released;
    edited[json::json_pointer(pointer)] = value;
    write(t, "bad_" + name, edited.dump());
  };
  bad("rope_theta_zero", "/text_config/rope_theta", 0);
  bad("rms_norm_eps_huge", "/text_config/rms_norm_eps", 1e30);
  bad("rms_norm_eps_zero", "/text_config/rms_norm_eps", 0.0);
  bad("swiglu_limit_negative", "/text_config/swiglu_limit", -1.0);
  bad("hidden_size_fraction", "/text_config/hidden_size", 64.5);
  bad("hidden_size_bool", "/text_config/hidden_size", true);
  bad("eos_beyond_vocab", "/text_config/eos_token_id", 5000);
  bad("eos_2_40", "/text_config/eos_token_id", int64_t{1} << 40);
  bad("aliases_disagree", "/text_config/index_topk_blocks", 4);
  bad("heads_zero", "/text_config/num_attention_heads", 0);
  bad("layers_huge", "/text_config/num_hidden_layers", int64_t{1} << 40);
  bad("rope_scaling_yarn", "/text_config/rope_scaling", json{{"type", "yarn"}, {"factor", 4}});
  bad("freq_not_flags", "/text_config/moe_layer_freq", json::array({0, 2, 1}));
  json no_head_dim = released;
  no_head_dim["text_config"].erase("head_dim");
  no_head_dim["text_config"]["num_attention_heads"] = 0;
  write(t, "bad_heads_zero_no_head_dim", no_head_dim.dump());
  // The vision part (tiny-vl's config.json edited).
  const json vl = json::parse(msa::model_config_to_json(msa::model_config_preset("tiny-vl")));
  const auto bad_vision = [&](const std::string& name, const std::string& pointer, const json& value) {
    json edited = vl;
    edited[json::json_pointer(pointer)] = value;
    write(t, "bad_vision_" + name, edited.dump());
  };
  bad_vision("act", "/vision_config/hidden_act", "quick_gelu");
  bad_vision("heads_not_divisor", "/vision_config/num_attention_heads", 3);
  bad_vision("merge_disagrees", "/vision_config/spatial_merge_size", 4);
  bad_vision("patch_huge", "/vision_config/patch_size", int64_t{1} << 40);
  bad_vision("segment_zero", "/vision_config/vision_segment_max_frames", 0);
  bad_vision("rope_type", "/vision_config/rope_parameters/rope_type", "default");
  bad_vision("same_ids", "/video_token_index", 500);
  bad_vision("not_object", "/vision_config", json::array({1}));
  write(t, "bad_deep", "{\"text_config\": " + std::string(300, '[') + std::string(300, ']') + "}");
  write(t, "bad_not_object", "[1, 2, 3]");
}

// ---- tokenizer.json ----
json small_tokenizer() {
  json vocab = json::object();
  // The GPT-2 byte alphabet's printable part is enough for ASCII text.
  int id = 0;
  for (char c = 33; c < 127; ++c) vocab[std::string(1, c)] = id++;
  vocab["\xc4\xa0"] = id++;  // "Ġ" (space)
  vocab["\xc4\x8a"] = id++;  // "Ċ" (newline)
  for (const char* merged : {"he", "ll", "hell", "hello", "\xc4\xa0w", "or", "\xc4\xa0wor", "ld"})
    vocab[merged] = id++;
  const json merges = json::array({"h e", "l l", "he ll", "hell o", "\xc4\xa0 w", "o r", "\xc4\xa0w or", "l d"});
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", json::array({{{"id", 200}, {"content", "]~!b["}, {"single_word", false}, {"lstrip", false},
                                         {"rstrip", false}, {"normalized", false}, {"special", true}},
                                        {{"id", 201}, {"content", "<think>"}, {"single_word", false}, {"lstrip", false},
                                         {"rstrip", false}, {"normalized", true}, {"special", false}}})},
          {"normalizer", {{"type", "Sequence"}, {"normalizers", json::array({{{"type", "NFC"}}})}}},
          {"pre_tokenizer",
           {{"type", "Sequence"},
            {"pretokenizers",
             json::array({{{"type", "Split"}, {"pattern", {{"Regex", R"( ?\p{L}+| ?\p{N}{1,3}|\s+(?!\S)|\s+|[^\s\p{L}\p{N}]+)"}}},
                           {"behavior", "Isolated"}, {"invert", false}},
                          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", false}}})}}},
          {"post_processor",
           {{"type", "TemplateProcessing"},
            {"single", json::array({{{"SpecialToken", {{"id", "]~!b["}, {"type_id", 0}}}},
                                    {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}})},
            {"pair", nullptr},
            {"special_tokens", {{"]~!b[", {{"id", "]~!b["}, {"ids", json::array({200})}, {"tokens", json::array({"]~!b["})}}}}}}},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
          {"model",
           {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr}, {"continuing_subword_prefix", nullptr},
            {"end_of_word_suffix", nullptr}, {"fuse_unk", false}, {"byte_fallback", false},
            {"ignore_merges", false}, {"vocab", vocab}, {"merges", merges}}}};
}

void tokenizer_seeds() {
  const std::string t = "fuzz_tokenizer";
  // Texts for the tokenizer make-model writes.
  write(t, "text_ascii", "hello world, the quick brown fox: 12345 + 678!\n\tdone");
  write(t, "text_unicode", "Stra\xc3\x9f" "e caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 \xf0\x9f\x98\x80 e\xcc\x81");
  write(t, "text_specials", "]~!b[]~b]user\nhi[e~[\n]~b]ai\n");
  write(t, "text_invalid_utf8", "abc\xff\xfe\xc3");
  const std::string nul(1, '\0');
  const json tok = small_tokenizer();
  write(t, "json_valid", tok.dump() + nul + "hello world <think> 123 ]~!b[ caf\xc3\xa9");
  const auto bad = [&](const std::string& name, const std::string& pointer, const json& value) {
    json edited = tok;
    edited[json::json_pointer(pointer)] = value;
    write(t, "json_bad_" + name, edited.dump() + nul + "hello");
  };
  bad("id_2_40", "/model/vocab/he", int64_t{1} << 40);
  bad("id_shared", "/model/vocab/ll", 0);
  bad("id_fraction", "/model/vocab/ll", 3.5);
  bad("added_conflict", "/added_tokens/0/id", 5);
  bad("added_id_huge", "/added_tokens/0/id", int64_t{1} << 33);
  bad("special_ids_huge", "/post_processor/special_tokens/]~0!b[/ids", json::array({int64_t{1} << 40}));
  bad("regex_invalid", "/pre_tokenizer/pretokenizers/0/pattern", json{{"Regex", "(((("}});
  bad("deep", "/decoder", json::parse(std::string(150, '[') + std::string(150, ']')));
  write(t, "json_bad_deep_text", std::string(300, '{') + nul + "x");
}

// ---- chat templates ----
void chat_template_seeds() {
  const std::string t = "fuzz_chat_template";
  const std::string nul(1, '\0');
  const std::string context =
      R"({"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},)"
      R"( {"role": "assistant", "content": "hello", "tool_calls": [{"name": "f", "arguments": {"x": [1, 2]}}]}],)"
      R"( "add_generation_prompt": true, "bos_token": "]~!b[", "eos_token": "[e~["})";
  write(t, "m3", "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}]~b]ai\n"
                 "{% else %}]~b]{{ message['role'] }}\n{% endif %}{{ message['content'] }}[e~[\n{% endfor %}"
                 "{% if add_generation_prompt %}]~b]ai\n{% endif %}" + nul + context);
  write(t, "features",
        "{%- set ns = namespace(n=0, last='') -%}\n"
        "{%- for m in messages if m.role != 'system' -%}\n"
        "  {%- set ns.n = ns.n + 1 -%}{{ loop.index }}/{{ loop.length }} {{ m.role | upper }}: "
        "{{ m.content | trim }}{% if m.tool_calls is defined %} {{ m.tool_calls | tojson(indent=2) }}{% endif %}\n"
        "  {%- if not loop.last %}, {% else %}.{% endif -%}\n"
        "{%- endfor -%}\n"
        "{{ ns.n }} {{ messages[0]['content'][1:3] }} {{ 'a,b,c'.split(',') | join('-') }} "
        "{{ range(3) | list | length }} {{ (7 // 2) ~ (7 % 3) ~ (2 * 3.5) }} "
        "{{ messages[5] is undefined }}{{ 'x' if 1 in [1, 2] else 'y' }}"
        "{% if raise is defined %}{{ raise_exception('no') }}{% endif %}" + nul + context);
  // Known-bad: unbounded nesting, a self-holding namespace, huge loops and strings, integer
  // overflow, deep contexts.
  write(t, "bad_deep_parens", "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}");
  write(t, "bad_long_chain", "{{ 'a'" + [] { std::string s; for (int i = 0; i < 3000; ++i) s += " ~ 'a'"; return s; }() + " }}");
  write(t, "bad_deep_blocks", [] { std::string s; for (int i = 0; i < 400; ++i) s += "{% if true %}"; for (int i = 0; i < 400; ++i) s += "{% endif %}"; return s; }());
  write(t, "bad_namespace_cycle", "{% set ns = namespace(a=1) %}{% set ns.self = ns %}{{ ns.self }}");
  write(t, "bad_namespace_deep", "{% set ns = namespace(l=[]) %}{% for i in range(100000) %}{% set ns.l = [ns.l] %}{% endfor %}{{ ns.l | length }}");
  write(t, "bad_shared_blowup", "{% set a = [1, 1, 1, 1] %}{% set b = [a, a, a, a] %}{% set c = [b, b, b, b] %}"
                                "{% set d = [c, c, c, c] %}{% set e = [d, d, d, d] %}{% set f = [e, e, e, e] %}"
                                "{% set g = [f, f, f, f] %}{% set h = [g, g, g, g] %}{% set i = [h, h, h, h] %}"
                                "{% set j = [i, i, i, i] %}{% set k = [j, j, j, j] %}{% set l = [k, k, k, k] %}{{ l }}");
  write(t, "bad_range_huge", "{% for i in range(10**12) %}x{% endfor %}{% for i in range(9223372036854775807) %}{% endfor %}");
  write(t, "bad_nested_loops", "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}");
  write(t, "bad_repeat_huge", "{{ 'abc' * 1000000000000 }}{{ ('x' * 1000000) * 1000000 }}");
  write(t, "bad_replace_huge", "{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}");
  write(t, "bad_int_overflow", "{{ 9223372036854775807 + 1 }}{{ -(-9223372036854775807 - 1) }}"
                               "{{ (-9223372036854775807 - 1) // -1 }}{{ 99999999999999999999 }}"
                               "{{ (9223372036854775807 * 2.0) | int }}{{ (-9223372036854775807 - 1) | abs }}");
  write(t, "bad_slice_step", "{{ 'abcdef'[::9223372036854775807] }}{{ [1,2,3][1::-9223372036854775807] }}");
  write(t, "bad_tojson_indent", "{{ messages | tojson(indent=1000000000) }}" + nul + context);
  write(t, "bad_deep_context", "{{ messages }}" + nul + "{\"messages\": " + std::string(300, '[') + std::string(300, ']') + "}");
}

// ---- op inputs ----
// The four control bytes of fuzz_op_inputs for op `name`: block 2, top-3, one local block,
// Impl::cpu, finite-value checks on.
std::string op_prefix(const std::string& name, bool check_finite = true, bool reference = false) {
  const std::vector<std::string> ops = msa::cli::op_command_names();
  const size_t index = std::find(ops.begin(), ops.end(), name) - ops.begin();
  const uint8_t block_and_topk = (2 - 1) | ((3 - 1) << 3);
  const uint8_t flags = (reference ? 4 : 0) | (check_finite ? 8 : 0);
  return std::string{static_cast<char>(index), static_cast<char>(block_and_topk), static_cast<char>(flags), 0};
}

void op_seeds() {
  const std::string t = "fuzz_op_inputs";
  msa::MsaParams p;
  p.block_size = 2;
  p.topk = 3;
  const int64_t Hq = 2, Hkv = 1, D = 4, Di = 4;
  const Tensor cu_q = ints({0, 2, 3}), cu_k = ints({0, 5, 7});
  const int64_t total_q = 3, total_k = 7;
  const Tensor q = normal({total_q, Hq, D}), k = normal({total_k, Hkv, D}), v = normal({total_k, Hkv, D});
  const Tensor qi = normal({total_q, Hkv, Di}), ki = normal({total_k, Di}), grad = normal({total_q, Hq, D});
  const auto sel = msa::indexer(qi, ki, cu_q, cu_k, p, msa::Impl::cpu);
  const auto fwd = msa::sparse_attention(q, k, v, sel.topk, cu_q, cu_k, p, msa::Impl::cpu);
  const auto dense = msa::dense_attention(q, k, v, cu_q, cu_k, p, msa::Impl::cpu);
  const Named all = {{"q", q},     {"k", k},       {"v", v},     {"qi", qi},       {"ki", ki},
                     {"do", grad}, {"topk", sel.topk}, {"o", fwd.o}, {"lse", fwd.lse},
                     {"cu_seqlens_q", cu_q}, {"cu_seqlens_k", cu_k}};
  const auto pick = [&](std::initializer_list<const char*> names, const Named& from) {
    Named out;
    for (const char* name : names)
      for (const auto& entry : from)
        if (entry.first == name) out.push_back(entry);
    return out;
  };
  const auto seed = [&](const std::string& op, const Named& tensors) {
    write(t, op, op_prefix(op) + safetensors_bytes(tensors));
    write(t, op + "_reference", op_prefix(op, true, true) + safetensors_bytes(tensors));
  };
  seed("indexer", pick({"qi", "ki", "cu_seqlens_q", "cu_seqlens_k"}, all));
  seed("sparse_attention", pick({"q", "k", "v", "topk", "cu_seqlens_q", "cu_seqlens_k"}, all));
  seed("sparse_attention_backward", pick({"q", "k", "v", "topk", "o", "lse", "do", "cu_seqlens_q", "cu_seqlens_k"}, all));
  seed("indexer_kl", pick({"q", "k", "lse", "qi", "ki", "topk", "cu_seqlens_q", "cu_seqlens_k"}, all));
  seed("train_step", pick({"q", "k", "v", "qi", "ki", "do", "cu_seqlens_q", "cu_seqlens_k"}, all));
  seed("dense_attention", pick({"q", "k", "v", "cu_seqlens_q", "cu_seqlens_k"}, all));
  Named dense_back = pick({"q", "k", "v", "do", "cu_seqlens_q", "cu_seqlens_k"}, all);
  dense_back.push_back({"o", dense.o});
  dense_back.push_back({"lse", dense.lse});
  seed("dense_attention_backward", dense_back);

  // Paged: two requests over 5 pages of 2 slots; queries 2 and 1.
  const Tensor page_table = Tensor::from_vector(std::vector<int32_t>{3, 0, 4, 1, 2, -1}, {2, 3});
  const Tensor seq_lens = ints({5, 3}), cu_paged = ints({0, 2, 3});
  Named paged = {{"q", q}, {"qi", qi}, {"k_cache", normal({5, Hkv, 2, D})}, {"v_cache", normal({5, Hkv, 2, D})},
                 {"index_key_cache", normal({5, 2, Di})}, {"page_table", page_table}, {"seq_lens", seq_lens},
                 {"cu_seqlens_q", cu_paged}};
  msa::PagedKvCache cache{.k_cache = paged[2].second, .v_cache = paged[3].second,
                          .index_key_cache = paged[4].second, .page_table = page_table, .seq_lens = seq_lens};
  const auto paged_sel = msa::paged_indexer(qi, cache, cu_paged, p, msa::Impl::cpu);
  paged.push_back({"topk", paged_sel.topk});
  seed("paged_indexer", pick({"qi", "index_key_cache", "page_table", "seq_lens", "cu_seqlens_q"}, paged));
  seed("paged_sparse_attention", pick({"q", "k_cache", "v_cache", "page_table", "seq_lens", "topk", "cu_seqlens_q"}, paged));
  seed("paged_dense_attention", pick({"q", "k_cache", "v_cache", "page_table", "seq_lens", "cu_seqlens_q"}, paged));

  // The issue's NaN cases: refused when checked, unspecified (but in bounds) when not.
  Named with_nan = pick({"q", "k", "v", "topk", "cu_seqlens_q", "cu_seqlens_k"}, all);
  with_nan[0].second = q.clone();
  with_nan[0].second.data<float>()[5] = std::numeric_limits<float>::quiet_NaN();
  write(t, "bad_nan_q_checked", op_prefix("sparse_attention") + safetensors_bytes(with_nan));
  write(t, "bad_nan_q_unchecked", op_prefix("sparse_attention", false) + safetensors_bytes(with_nan));
  Named nan_qi = pick({"qi", "ki", "cu_seqlens_q", "cu_seqlens_k"}, all);
  nan_qi[0].second = Tensor::full(qi.shape(), msa::DType::f32, std::nan(""));
  write(t, "bad_nan_qi_checked", op_prefix("indexer") + safetensors_bytes(nan_qi));
  write(t, "bad_nan_qi_unchecked", op_prefix("indexer", false) + safetensors_bytes(nan_qi));
  Named nan_lse = pick({"q", "k", "lse", "qi", "ki", "topk", "cu_seqlens_q", "cu_seqlens_k"}, all);
  nan_lse[2].second = fwd.lse.clone();
  nan_lse[2].second.data<float>()[1] = std::numeric_limits<float>::quiet_NaN();
  write(t, "bad_nan_lse_checked", op_prefix("indexer_kl") + safetensors_bytes(nan_lse));
  write(t, "bad_nan_lse_unchecked", op_prefix("indexer_kl", false) + safetensors_bytes(nan_lse));
  Named bad_cu = pick({"qi", "ki", "cu_seqlens_q", "cu_seqlens_k"}, all);
  bad_cu[2].second = ints({0, 9, 3});
  write(t, "bad_cu_seqlens", op_prefix("indexer") + safetensors_bytes(bad_cu));
  Named bad_pages = pick({"q", "k_cache", "v_cache", "page_table", "seq_lens", "cu_seqlens_q"}, paged);
  bad_pages[3].second = Tensor::from_vector(std::vector<int32_t>{3, 0, 99, 1, -7, -1}, {2, 3});
  write(t, "bad_page_table", op_prefix("paged_dense_attention") + safetensors_bytes(bad_pages));
}

// Request bodies of `msa serve` (the first byte: bit 0 chat, bit 1 also model output for the
// M3 parser, the rest its piece size), valid and refused, and M3 outputs with reasoning and
// tool calls.
void serve_request_seeds() {
  const std::string t = "fuzz_serve_request";
  const auto seed = [&](const std::string& name, uint8_t control, const std::string& body) {
    write(t, name, std::string(1, static_cast<char>(control)) + body);
  };
  seed("completion_text", 0, R"({"model": "m", "prompt": "hello", "max_tokens": 16, "temperature": 0.7, "top_p": 0.9,
      "top_k": 40, "seed": 5, "stop": ["\n", "end"], "stream": true, "stream_options": {"include_usage": true}})");
  seed("completion_ids", 0, R"({"prompt": [[1, 2, 3, 4000]], "stop_token_ids": [2], "ignore_eos": false, "n": 1,
      "logprobs": null, "echo": false, "best_of": 1, "suffix": "", "user": "u"})");
  seed("chat_tools", 1, R"({"model": "m", "messages": [{"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
      {"role": "assistant", "content": "", "reasoning_content": "look it up",
       "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": "{\"n\": 3}"}}]},
      {"role": "tool", "tool_call_id": "c0", "content": "sunny"}],
      "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
      "tool_choice": "auto", "parallel_tool_calls": true, "max_completion_tokens": 64,
      "chat_template_kwargs": {"thinking_mode": "enabled"}})");
  seed("bad_fields", 1, R"({"messages": [{"role": "user", "content": "x"}], "n": 2, "logprobs": true,
      "temperature": -1, "unknown": {"deep": [[[1]]]}})");
  seed("bad_types", 0, R"({"prompt": ["a", "b"], "max_tokens": 1e400, "seed": "7"})");
  seed("bad_utf8", 0, "{\"prompt\": \"\xff\xfe\\ud800\"}");
  seed("bad_deep", 1, std::string(300, '['));
  const std::string ns = "]<]minimax[>[";
  seed("output_m3", 2 | (3 << 2), "<mm:think>plan</mm:think>answer" + ns + "<tool_call>\n" + ns +
       "<invoke name=\"f\">" + ns + "<n>3" + ns + "</n>" + ns + "<l>" + ns + "<item>1.5" + ns + "</item>" + ns +
       "</l>" + ns + "<o>" + ns + "<b>true" + ns + "</b>" + ns + "</o>" + ns + "</invoke>\n" + ns + "</tool_call>");
  seed("output_open_reasoning", 2 | 4, "thinking</mm:think>done" + ns + "<tool_call>" + ns + "<invoke name=\"f\">");
}

#ifdef MSA_SEEDS_WITH_IMAGES
// fuzz_image_decode: small images of every PNG colour type and depth, transparency, JPEG
// colour spaces and codings, and broken files (truncated, bad CRC, another format, a header
// far beyond the limits).
void image_seeds() {
  const std::string t = "fuzz_image_decode";
  using msa::testing::JpegSpec;
  using msa::testing::PngSpec;
  std::vector<uint8_t> rgb(7 * 5 * 3), rgba(7 * 5 * 4);
  for (size_t i = 0; i < rgb.size(); ++i) rgb[i] = static_cast<uint8_t>(i * 37);
  for (size_t i = 0; i < rgba.size(); ++i) rgba[i] = static_cast<uint8_t>(i * 53);
  const std::string png_rgb = msa::testing::png_of_samples(7, 5, 3, rgb);
  write(t, "png_rgb", png_rgb);
  write(t, "png_rgba", msa::testing::png_of_samples(7, 5, 4, rgba));
  write(t, "png_grey_alpha", msa::testing::png_of_samples(7, 5, 2, std::vector<uint8_t>(rgba.begin(), rgba.begin() + 70)));
  write(t, "png_1x1", msa::testing::png_of_samples(1, 1, 3, {1, 2, 3}));
  PngSpec interlaced;
  interlaced.width = 7;
  interlaced.height = 5;
  interlaced.interlaced = true;
  interlaced.rows = rgb;
  write(t, "png_interlaced", msa::testing::png_bytes(interlaced));
  for (const int depth : {1, 2, 4, 8, 16}) {
    PngSpec grey;
    grey.width = 9;
    grey.height = 3;
    grey.color_type = PNG_COLOR_TYPE_GRAY;
    grey.bit_depth = depth;
    grey.rows.resize(msa::testing::png_row_bytes(grey) * 3);
    for (size_t i = 0; i < grey.rows.size(); ++i) grey.rows[i] = static_cast<uint8_t>(i * 29 + 7);
    if (depth == 8) grey.transparent = png_color_16{0, 0, 0, 0, 7};
    write(t, "png_grey_" + std::to_string(depth), msa::testing::png_bytes(grey));
  }
  PngSpec rgba16;
  rgba16.width = 3;
  rgba16.height = 2;
  rgba16.color_type = PNG_COLOR_TYPE_RGB_ALPHA;
  rgba16.bit_depth = 16;
  rgba16.rows.resize(3 * 2 * 8);
  for (size_t i = 0; i < rgba16.rows.size(); ++i) rgba16.rows[i] = static_cast<uint8_t>(i * 41);
  write(t, "png_rgba_16", msa::testing::png_bytes(rgba16));
  PngSpec palette;
  palette.width = 4;
  palette.height = 2;
  palette.color_type = PNG_COLOR_TYPE_PALETTE;
  palette.bit_depth = 4;
  palette.palette = {{255, 0, 0}, {0, 255, 0}, {0, 0, 255}};
  palette.palette_alpha = {255, 0, 128};
  palette.rows = {0x01, 0x20, 0x12, 0x00};
  write(t, "png_palette_alpha", msa::testing::png_bytes(palette));

  JpegSpec jpeg;
  jpeg.width = 16;
  jpeg.height = 16;
  jpeg.quality = 80;
  jpeg.full_chroma = false;
  jpeg.samples.resize(16 * 16 * 3);
  for (size_t i = 0; i < jpeg.samples.size(); ++i) jpeg.samples[i] = static_cast<uint8_t>(i * 11);
  const std::string jpeg_rgb = msa::testing::jpeg_bytes(jpeg);
  write(t, "jpeg_420", jpeg_rgb);
  jpeg.progressive = true;
  write(t, "jpeg_progressive", msa::testing::jpeg_bytes(jpeg));
  JpegSpec grey = jpeg;
  grey.progressive = false;
  grey.components = 1;
  grey.input_space = JCS_GRAYSCALE;
  grey.samples.resize(16 * 16);
  write(t, "jpeg_grey", msa::testing::jpeg_bytes(grey));
  JpegSpec cmyk = jpeg;
  cmyk.progressive = false;
  cmyk.width = 8;
  cmyk.height = 8;
  cmyk.components = 4;
  cmyk.input_space = JCS_CMYK;
  cmyk.samples.resize(8 * 8 * 4);
  write(t, "jpeg_cmyk", msa::testing::jpeg_bytes(cmyk));
  cmyk.file_space = JCS_YCCK;
  write(t, "jpeg_ycck", msa::testing::jpeg_bytes(cmyk));

  write(t, "bad_png_truncated", png_rgb.substr(0, png_rgb.size() / 2));
  std::string bad_crc = png_rgb;
  bad_crc[bad_crc.size() - 20] = static_cast<char>(bad_crc[bad_crc.size() - 20] ^ 0x40);
  write(t, "bad_png_crc", bad_crc);
  write(t, "bad_jpeg_truncated", jpeg_rgb.substr(0, jpeg_rgb.size() / 2));
  write(t, "bad_gif", std::string("GIF89a\x01\x00\x01\x00\x00\x00\x00", 13));
  write(t, "bad_empty", "");
  // IHDR of 60000 x 60000 (valid CRC) and an empty IDAT: refused from the header.
  std::string huge = png_rgb.substr(0, 33);
  for (const int at : {16, 20})
    for (int i = 0; i < 4; ++i) huge[at + i] = static_cast<char>(60000u >> (24 - 8 * i));
  uint32_t crc = 0xffffffffu;
  for (size_t i = 12; i < 29; ++i) {
    crc ^= static_cast<uint8_t>(huge[i]);
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1)));
  }
  for (int i = 0; i < 4; ++i) huge[29 + i] = static_cast<char>(~crc >> (24 - 8 * i));
  write(t, "bad_png_huge", huge + std::string("\0\0\0\0IDAT\x35\xaf\x06\x1e", 12));
}
#endif

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: fuzz_make_seeds OUT_DIR (tests/fuzz/corpus)\n");
    return 2;
  }
  root = argv[1];
  fs::create_directories(root);
  msa::set_num_threads(1);
  safetensors_seeds();
  config_seeds();
  tokenizer_seeds();
  chat_template_seeds();
  op_seeds();
  serve_request_seeds();
#ifdef MSA_SEEDS_WITH_IMAGES
  image_seeds();
#endif
  return 0;
}
