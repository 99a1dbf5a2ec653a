#!/usr/bin/env python3
"""A short protocol check of a running `msa serve`, with the Python standard library only (the
GPU machine has no openai package): health, models, completions whole and streamed (token-id
and text prompts), chat when the model has a chat template, a refused field, greedy output
equal to `msa run` on the same device, and no used KV pages afterwards.

usage: serve_check.py BASE_URL MSA_BINARY MODEL_DIR DEVICE
Prints one line per check ("ok ..." / "FAIL ...") and exits 1 when any failed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

base, msa, model, device = sys.argv[1:5]
failures = 0


def request(method: str, path: str, body=None, timeout: float = 600):
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    req = urllib.request.Request(base + path, data=data, method=method,
                                 headers={"Content-Type": "application/json"} if data else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def check(name: str, ok: bool, detail: str = "") -> None:
    global failures
    failures += not ok
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


def stream(path: str, body: dict) -> tuple[list[dict], bool]:
    req = urllib.request.Request(base + path, data=json.dumps(dict(body, stream=True)).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    chunks, done = [], False
    with urllib.request.urlopen(req, timeout=600) as r:
        for raw in r:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunks.append(json.loads(line[6:]))
    return chunks, done


status, body = request("GET", "/health")
check("GET /health", status == 200 and json.loads(body)["status"] == "ok", body.decode()[:80])
status, body = request("GET", "/v1/models")
check("GET /v1/models", status == 200 and len(json.loads(body)["data"]) == 1, body.decode()[:120])

prompt = [(i * 7919) % 1000 + 1 for i in range(300)]
started = time.monotonic()
status, body = request("POST", "/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0})
whole = json.loads(body)
check("POST /v1/completions (token ids)", status == 200 and whole["usage"]["prompt_tokens"] == 300
      and whole["usage"]["completion_tokens"] >= 1, f"{time.monotonic() - started:.2f} s, usage {whole.get('usage')}")

run = subprocess.run([msa, "run", "--model", model, "--device", device, "--prompt-tokens",
                      ",".join(map(str, prompt)), "--max-tokens", "16"], capture_output=True, timeout=600)
ids = [int(x) for x in run.stdout.split(b"\n", 1)[0].split()]
check("greedy tokens: server == msa run", run.returncode == 0 and len(ids) == whole["usage"]["completion_tokens"],
      f"msa run made {len(ids)} tokens, the server {whole['usage']['completion_tokens']}")
if b"\n" in run.stdout.strip():  # a tokenizer: msa run printed the text too
    text = run.stdout.split(b"\n", 1)[1][:-1].decode("utf-8", errors="replace")
    check("greedy text: server == msa run", text == whole["choices"][0]["text"],
          f"{text[:40]!r} vs {whole['choices'][0]['text'][:40]!r}")

chunks, done = stream("/v1/completions", {"prompt": prompt, "max_tokens": 16, "temperature": 0,
                                          "stream_options": {"include_usage": True}})
streamed = "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))
usage = [c["usage"] for c in chunks if c.get("usage")]
check("streamed completion == whole, ends with [DONE]", done and streamed == whole["choices"][0]["text"]
      and usage and usage[0]["completion_tokens"] == whole["usage"]["completion_tokens"], f"{len(chunks)} chunks")

status, body = request("POST", "/v1/completions", {"prompt": "hello world", "max_tokens": 8, "temperature": 0})
if status == 200:
    check("POST /v1/completions (text)", True, json.loads(body)["choices"][0]["text"][:40].__repr__())
    status, body = request("POST", "/v1/chat/completions",
                           {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0})
    check("POST /v1/chat/completions", status == 200 and json.loads(body)["object"] == "chat.completion",
          body.decode()[:160])
    chunks, done = stream("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}],
                                                   "max_tokens": 8, "temperature": 0})
    check("streamed chat ends with [DONE]", done and chunks[0]["choices"][0]["delta"].get("role") == "assistant")
else:
    check("text prompts need the tokenizer (this build has none)", status == 400, body.decode()[:160])

status, body = request("POST", "/v1/completions", {"prompt": [1, 2], "n": 2})
check("a refused field: 400 naming it", status == 400 and json.loads(body)["error"]["param"] == "n", body.decode())

for _ in range(100):
    _, body = request("GET", "/metrics")
    used = re.search(rb'msa_kv_cache_pages\{state="used"\} (\d+)', body)
    if used and used.group(1) == b"0":
        break
    time.sleep(0.1)
check("no used KV pages afterwards", bool(used) and used.group(1) == b"0")
print(f"serve_check: {'all passed' if failures == 0 else f'{failures} FAILED'}")
sys.exit(1 if failures else 0)
