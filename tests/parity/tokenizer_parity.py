#!/usr/bin/env python3
"""Parity of msa's tokenizer and chat template with Hugging Face `tokenizers` and `jinja2`.

Trains two small byte-level BPE tokenizers with `tokenizers` (GPT-4o-style Split regex +
ByteLevel with ignore_merges; GPT-2-style ByteLevel regex with NFC, a BOS post-processor
and "a b" string merges), both with MiniMax-style special tokens, then encodes and decodes
a varied corpus (unicode incl. CJK / emoji / combining marks, whitespace runs, tabs and
newlines, digits, code, special tokens inline) with `tokenizers` and with msa (through the
test_tokenizer_tool binary) and requires identical ids and strings. It also renders a
MiniMax/ChatML-style chat template with jinja2 (configured as transformers does) and with
msa. Exits 1 on any difference.

usage: tokenizer_parity.py --tool PATH/test_tokenizer_tool --workdir DIR
"""
import argparse
import json
import os
import random
import subprocess
import sys

try:
    import jinja2
    import jinja2.sandbox
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from tokenizers import pre_tokenizers, processors, trainers
except ImportError as error:  # a missing venv must fail the test, not skip it
    sys.exit(f"tokenizer_parity: {error}; run scripts/install_deps.sh "
             "(installs tests/parity/requirements-tokenizer.txt into build/venv)")

GPT4O_PATTERN = "|".join([
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
SPECIAL_TOKENS = ["]~!b[", "]~b]", "[e~[", "]!p~[", "]<]image[>[", "]<]start of image[>[",
                  "]<]end of image[>[", "<think>", "</think>"]
PLAIN_ADDED_TOKENS = ["<minimax:tool_call>", "</minimax:tool_call>", "Ġhello world"]

WORDS = ("the of and to in is that for it as was with be by on not he I this are or his from at "
         "which but have an they you were her she there one all we can their has been if more when "
         "will would who so no Hello World tokenizer attention sparse MiniMax model token's don't "
         "I'm we've they'll she'd it's YOU'RE HE'S Straße naïve café résumé coöperate façade "
         "Ελληνικά Ωμέγα Привет мир Москва Ünïcödé ÀÉÎÕÜ ǅungla ǈ ǋ ſ ﬁ ﬀ "
         "中文 汉字 分词器 测试 你好 世界 日本語 ひらがな カタカナ 한국어 안녕하세요 "
         "مرحبا العربية שלום עברית हिन्दी नमस्ते ไทย ภาษา ትግርኛ ᏣᎳᎩ").split()
PIECES = ["  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "\u00a0", "\u3000", "\u2003",
          "\u200b", "\u180e", "\u2028", "\u0085", "0", "7", "42", "123", "2024", "3.14159",
          "1,000,000", "0x1F", "-12", "1e-5", "😀", "👍🏽", "👨‍👩‍👧", "🇫🇷", "🤖🤖", "e\u0301",
          "a\u0308", "n\u0303", "\u0301", "\u0308\u0301", "Å", "A\u030a", "ﾊﾟ", "①②", "Ⅻ",
          "½", "²", "٣", "१२", "𝔘𝔫𝔦", "𝟘𝟙", "def f(x):", "return x**2", "{'a': [1, 2]}",
          "if (a && b) { c++; }", "// comment", "/* c */", "#include <vector>", "x->y", "a::b",
          "<html>", "</div>", "https://example.com/a?b=c&d=e", "user@example.com", "C:\\path\\",
          "'s", "'S", "'t", "'re", "'VE", "'m", "'ll", "'d", "'ſ", "!!!", "...", "?!", "---",
          "***", "$$", "%", "@#", "~", "``", "\"", "'", "(", ")", "[", "]", "{", "}", "|", "\\",
          "/", "//\n", "...\n", ";\r\n"] + SPECIAL_TOKENS + PLAIN_ADDED_TOKENS + [
          "]~!", "b[", "[e~", "]<]image", "<think", "think>", "<minimax:tool", "]~b", "Ġhello"]

HANDWRITTEN = [
    "", " ", "  ", "\n", "\t", " \t \n", "Hello world", "Hello  world", " Hello world ",
    "hello\nworld\n\n\nagain", "tabs\tand\t\tspaces    here",
    "The quick brown fox jumps over the lazy dog. 1234567890",
    "I'm sure you're right, they'll see we've done it's fine, don't worry'S",
    "HELLO'S WORLD'LL Don'T", "a1b2c3 12345 123456 1234567", "3.14 vs 2,718 vs 1e10",
    "中文分词测试：你好，世界！", "日本語のテキスト、カタカナとひらがな。", "한국어 문장입니다.",
    "emoji 😀😃😄 👍🏽 family 👨‍👩‍👧 flags 🇫🇷🇯🇵", "combining e\u0301 a\u0308 o\u0302 stacked a\u0301\u0302\u0303",
    "NFC: Cafe\u0301 vs Café, A\u030a vs Å, \u212b angstrom", "mixed العربية and English and עברית",
    "def main():\n    print('hi')\n    return 0\n", "int main() {\n\treturn 0;\n}\n",
    "]~!b[]~b]system\nYou are MiniMax.[e~[\n]~b]user\nHi![e~[\n]~b]ai\n<think>\nhmm\n</think>\n",
    "text]~!b[text[e~[text", "]~!b[]~!b[]~!b[", " ]~b] ", "]<]start of image[>[]<]image[>[]<]image[>[]<]end of image[>[",
    "<minimax:tool_call>{\"x\": 1}</minimax:tool_call>", "Ġhello world and hello world",
    "]!p~[]!p~[pad", "trailing spaces   ", "   leading spaces", "\n\n\n", "a\r\nb\rc\nd",
    "\u00a0nbsp\u00a0\u00a0x", "ideographic\u3000space", "zero\u200bwidth", "mongolian\u180evowel",
    "line\u2028separator", "next\u0085line", "ǅungla ǈ Ǌ title case", "ﬁnance ﬀ ligatures",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math 𝟘𝟙𝟚", "½ ² ٣ १२ Ⅻ ① numbers", "Straße STRASSE ſ long s 'ſ",
]


def random_text(rng):
    parts = []
    for _ in range(rng.randint(1, 14)):
        roll = rng.random()
        if roll < 0.45:
            parts.append(rng.choice(WORDS))
        elif roll < 0.85:
            parts.append(rng.choice(PIECES))
        else:
            parts.append(" ")
        if rng.random() < 0.5:
            parts.append(" " * rng.choice([1, 1, 1, 2, 3]))
    return "".join(parts)


def training_corpus(rng):
    lines = HANDWRITTEN[:]
    for _ in range(3000):
        lines.append(random_text(rng))
    for _ in range(1500):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))))
    return lines


def train(corpus, pre_tokenizer, normalizer):
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=(t != "</minimax:tool_call>"))
                    for t in PLAIN_ADDED_TOKENS])
    return tok


def build_tokenizers(workdir, rng):
    corpus = training_corpus(rng)
    paths = {}

    # A: GPT-4o / MiniMax style: Split regex + ByteLevel without its own regex, ignore_merges.
    split = pre_tokenizers.Split(Regex(GPT4O_PATTERN), behavior="isolated", invert=False)
    a = train(corpus, pre_tokenizers.Sequence(
        [split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), None)
    config = json.loads(a.to_str())
    config["model"]["ignore_merges"] = True
    paths["gpt4o_split"] = write_json(workdir, "tokenizer_gpt4o_split.json", config)

    # B: GPT-2 style: ByteLevel regex with prefix space, NFC, BOS post-processor, string merges.
    b = train(corpus, pre_tokenizers.ByteLevel(add_prefix_space=True, use_regex=True), normalizers.NFC())
    bos = b.token_to_id("]~!b[")
    b.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="]~!b[ $A", special_tokens=[("]~!b[", bos)]),
    ])
    config = json.loads(b.to_str())
    config["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in config["model"]["merges"]]
    paths["gpt2_nfc"] = write_json(workdir, "tokenizer_gpt2_nfc.json", config)
    return paths


def write_json(workdir, name, value):
    path = os.path.join(workdir, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, ensure_ascii=False)
    return path


def test_strings(rng):
    strings = HANDWRITTEN[:]
    for _ in range(1500):
        strings.append(random_text(rng))
    # Long strings exercise the merge loop and the word cache.
    for _ in range(20):
        strings.append("".join(random_text(rng) for _ in range(40)))
    return strings


CHAT_TEMPLATE = """{#- A MiniMax-style template (]~b]role ... [e~[), in the Jinja subset msa supports. -#}
{%- set ns = namespace(system='You are a helpful assistant.', turns=0) -%}
{%- if messages | length == 0 -%}
  {{- raise_exception('messages must not be empty') -}}
{%- endif -%}
{%- if messages[0]['role'] == 'system' -%}
  {%- set ns.system = messages[0].content | trim -%}
  {%- set conversation = messages[1:] -%}
{%- else -%}
  {%- set conversation = messages -%}
{%- endif -%}
{{ bos_token ~ ']~b]system' + '\\n' + ns.system }}
{%- if tools is defined and tools %}

# Tools
<tools>
{% for tool in tools %}
<tool>{{ tool | tojson }}</tool>
{% endfor %}
</tools>
{%- endif %}
[e~[
{% for message in conversation %}
  {%- if message.role not in ['user', 'assistant', 'tool'] -%}
    {{- raise_exception('unknown role: ' ~ message.role) -}}
  {%- endif -%}
  {%- set ns.turns = ns.turns + 1 -%}
  {%- if message['role'] == 'assistant' %}
]~b]ai
    {%- set content = message.content -%}
    {%- if '</think>' in content and not loop.last -%}
      {%- set content = content.split('</think>')[-1].lstrip('\\n') -%}
    {%- endif %}
{{ content }}
    {%- if message.tool_calls is defined and message.tool_calls %}
<minimax:tool_call>
      {%- for call in message.tool_calls %}
<invoke name="{{ call.name }}">
        {%- for key, value in call.arguments | items %}
<parameter name="{{ key }}">{{ value if value is string else value | tojson }}</parameter>
        {%- endfor %}
</invoke>
      {%- endfor %}
</minimax:tool_call>
    {%- endif %}
[e~[
  {%- elif message.role == 'tool' %}
]~b]tool
{{ message.content }}[e~[
  {%- else %}
]~b]user{% if message.name is defined %} name={{ message.name }}{% endif %}

{{ message.content }}[e~[
  {%- endif %}
  {% if loop.last and message.role != 'assistant' %}
{# comment between turns #}
  {% endif %}
{% endfor -%}
{%- if add_generation_prompt -%}
]~b]ai
<think>
{%- elif ns.turns > 3 and (conversation | last).role == 'user' or false -%}
{{ '' }}
{%- else -%}
{{- eos_token if eos_token else '' -}}
{%- endif -%}
{# loop helpers and expressions #}
{%- if debug is defined and debug %}
{% for m in messages if m.role != 'system' %}{{ loop.index }}/{{ loop.length }}:{{ loop.index0 }}{{ ',' if not loop.last }}{{ m.role[:1] | upper }}{% endfor %}
{{ messages | length > 2 }} {{ 7 // 2 }} {{ 7 % 3 }} {{ -3 + 10 * 2 }} {{ 'abc'[::-1] }} {{ [1, 2, 3] | join('-') }}
{{ none is none }} {{ 'x' is string }} {{ ns.turns is number }} {{ 'a' ~ 1 ~ true }} {{ {'k': 'v'}['k'] }} {{ undefined_var | default('dflt') }}
{%- endif %}
"""

CHAT_CASES = [
    {"messages": [{"role": "user", "content": "Hello!"}], "add_generation_prompt": True},
    {"messages": [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "<think>\nadd</think>\n\n4"},
                  {"role": "user", "content": "and 3+3?", "name": "bob"}],
     "add_generation_prompt": True, "debug": True},
    {"messages": [{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": "calling",
                   "tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3,
                                                                         "units": ["c", "f"], "x": None}}]},
                  {"role": "tool", "content": "{\"temp\": 21}"},
                  {"role": "assistant", "content": "<think>ok</think>It is 21°C in Paris 🌤"}],
     "add_generation_prompt": False, "eos_token": "[e~[",
     "tools": [{"name": "get_weather", "description": "Weather \"now\" <b>",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}]},
    {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                  {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"},
                  {"role": "user", "content": "e\n\n  spaced  "}],
     "add_generation_prompt": False, "debug": True},
    {"messages": [{"role": "robot", "content": "x"}], "add_generation_prompt": True},
    {"messages": [], "add_generation_prompt": True},
]


def render_with_jinja2(template, context):
    # As transformers renders chat templates: trim_blocks, lstrip_blocks, its tojson,
    # raise_exception.
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(**context)
    except jinja2.exceptions.TemplateError as error:
        return {"error": str(error)}


def run_tool(tool, workdir, request, name):
    request_path = os.path.join(workdir, f"request_{name}.json")
    response_path = os.path.join(workdir, f"response_{name}.json")
    write_json(workdir, os.path.basename(request_path), request)
    result = subprocess.run([tool, request_path, response_path], capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"tokenizer_parity: {tool} failed ({result.returncode}): {result.stderr}")
    with open(response_path, encoding="utf-8") as f:
        return json.load(f)


def check_tokenizer(tool, workdir, name, path, strings, rng):
    hf = Tokenizer.from_file(path)
    encode_cases, expected_ids = [], []
    for text in strings:
        for special in (False, True):
            encode_cases.append({"text": text, "add_special_tokens": special})
            expected_ids.append(hf.encode(text, add_special_tokens=special).ids)
    decode_cases = []
    for ids in expected_ids[::2]:
        decode_cases.append({"ids": ids, "skip_special_tokens": False})
        decode_cases.append({"ids": ids, "skip_special_tokens": True})
    vocab = hf.get_vocab_size(with_added_tokens=True)
    for _ in range(500):  # arbitrary id runs: partial UTF-8 sequences must decode alike
        decode_cases.append({"ids": [rng.randrange(vocab) for _ in range(rng.randint(1, 8))],
                             "skip_special_tokens": rng.random() < 0.5})
    expected_text = [hf.decode(c["ids"], skip_special_tokens=c["skip_special_tokens"]) for c in decode_cases]

    got = run_tool(tool, workdir, {"tokenizer": path, "encode": encode_cases, "decode": decode_cases}, name)
    failures = 0
    for case, want, have in zip(encode_cases, expected_ids, got["encode"]):
        if want != have:
            failures += 1
            if failures <= 10:
                print(f"[{name}] encode mismatch (add_special_tokens={case['add_special_tokens']}) "
                      f"for {case['text']!r}:\n  tokenizers: {want}\n  msa:        {have}")
    for case, want, have in zip(decode_cases, expected_text, got["decode"]):
        if want != have:
            failures += 1
            if failures <= 20:
                print(f"[{name}] decode mismatch for {case}:\n  tokenizers: {want!r}\n  msa:        {have!r}")
    round_trips = sum(1 for text, ids in zip(strings, expected_ids[::2])
                      if hf.decode(ids, skip_special_tokens=False) == text)
    if got["vocab_size"] != vocab:
        failures += 1
        print(f"[{name}] vocab_size: tokenizers {vocab}, msa {got['vocab_size']}")
    print(f"[{name}] {len(encode_cases)} encodings of {len(strings)} strings, {len(decode_cases)} decodings, "
          f"vocab {vocab}: {'all identical' if failures == 0 else f'{failures} differ'} "
          f"({round_trips}/{len(strings)} strings round-trip exactly)")
    return failures


def check_chat_template(tool, workdir):
    renders, expected = [], []
    for case in CHAT_CASES:
        context = {"bos_token": "]~!b[", "eos_token": ""}
        context.update(case)
        renders.append({"template": CHAT_TEMPLATE, "context": context})
        expected.append(render_with_jinja2(CHAT_TEMPLATE, context))
    got = run_tool(tool, workdir, {"render": renders}, "chat")
    failures = 0
    for case, want, have in zip(renders, expected, got["render"]):
        same = (isinstance(want, dict) and isinstance(have, dict)) or want == have
        if isinstance(want, dict) and isinstance(have, dict):
            same = want["error"] in have["error"]  # msa prefixes its errors
        if not same:
            failures += 1
            print(f"[chat] mismatch for {json.dumps(case['context'])[:200]}:\n"
                  f"  jinja2: {want!r}\n  msa:    {have!r}")
    errors = sum(1 for w in expected if isinstance(w, dict))
    print(f"[chat] {len(renders)} renders ({errors} raise_exception): "
          f"{'all identical' if failures == 0 else f'{failures} differ'}")
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", required=True, help="path of the test_tokenizer_tool binary")
    parser.add_argument("--workdir", required=True, help="folder for the tokenizers and requests")
    args = parser.parse_args()
    os.makedirs(args.workdir, exist_ok=True)
    rng = random.Random(20240601)
    paths = build_tokenizers(args.workdir, rng)
    strings = test_strings(rng)
    failures = 0
    for name, path in paths.items():
        failures += check_tokenizer(args.tool, args.workdir, name, path, strings, rng)
    failures += check_chat_template(args.tool, args.workdir)
    if failures:
        print(f"tokenizer_parity: FAILED ({failures} differences)")
        return 1
    print("tokenizer_parity: all identical")
    return 0


if __name__ == "__main__":
    sys.exit(main())
