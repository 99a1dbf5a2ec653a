"""The load test of `msa serve` (loopback only, bounded): 200 requests from 32 concurrent
clients on the `small` made model (bf16 weights, MSA blocks of 64 tokens: prompts past 512
tokens make the sparse layers select blocks), mixed prompt lengths (1 to ~900 tokens), some
sharing system prompts of whole pages (the prefix cache serves them), completions and chat,
some streamed, some cancelled mid-stream.

Checks: every request completes (or is cancelled, as intended); every greedy answer equals
the answer the same request gets alone (from a second server with batch 1 and no prefix
cache: batching and prefix caching do not change the tokens); the prefix cache was used;
no page leaks (/metrics: no used pages afterwards); the server counted every request.

Run: MSA_CLI=build/tools/msa build/serve-venv/bin/python -m unittest -v tests/serve/test_load.py
"""

from __future__ import annotations

import os
import random
import shutil
import sys
import tempfile
import threading
import time
import unittest
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_util import Server, make_model  # noqa: E402

# The ASan build's run (scripts/sanitize_and_fuzz.sh) sets a smaller count: the sanitized
# server is ~10x slower, and there the test looks for memory errors, not throughput.
REQUESTS = int(os.environ.get("MSA_SERVE_LOAD_REQUESTS", "200"))
CLIENTS = min(32, REQUESTS)
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "light", "quiet", "orbit", "maple", "north", "ember"]


def build_requests(vocab: int) -> list[dict]:
    rng = random.Random(2026)
    system_ids = [[rng.randrange(3, vocab) for _ in range(n)] for n in (128, 256, 192)]  # 2-4 pages of 64
    system_texts = [" ".join(rng.choice(WORDS) for _ in range(n)) for n in (60, 120)]
    requests = []
    for i in range(REQUESTS):
        suffix = rng.choice([1, 5, 30, 100, 300, 600])
        chat = rng.random() < 0.3
        stream = rng.random() < 0.5
        cancel = stream and rng.random() < 0.2
        if i in (1, 2):  # a cancelled one and a streamed one in any count
            stream, cancel = True, i == 1
        req = {"i": i, "chat": chat, "stream": stream, "cancel": cancel,
               "max_tokens": 400 if cancel else rng.randrange(4, 20)}
        if chat:
            messages = []
            if rng.random() < 0.7:
                messages.append({"role": "system", "content": rng.choice(system_texts)})
            messages.append({"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(suffix // 3 + 1))})
            req["messages"] = messages
        else:
            prefix = rng.choice(system_ids) if rng.random() < 0.6 else []
            req["prompt"] = prefix + [rng.randrange(3, vocab) for _ in range(suffix)]
        requests.append(req)
    return requests


def send(client, req: dict) -> dict:
    """Runs one request; returns {text, completion_tokens, cached, finish} (cancelled: partial)."""
    common = dict(model="small", max_tokens=req["max_tokens"], temperature=0)
    if req.get("cancel"):
        common["extra_body"] = {"ignore_eos": True}
    if req["chat"]:
        create = lambda **kw: client.chat.completions.create(messages=req["messages"], **common, **kw)  # noqa: E731
    else:
        create = lambda **kw: client.completions.create(prompt=req["prompt"], **common, **kw)  # noqa: E731
    if not req["stream"]:
        r = create()
        choice = r.choices[0]
        text = choice.message.content if req["chat"] else choice.text
        return {"text": text, "completion_tokens": r.usage.completion_tokens, "finish": choice.finish_reason,
                "cached": r.usage.prompt_tokens_details.cached_tokens}
    text, finish, usage, chunks = "", None, None, 0
    stream = create(stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        chunks += 1
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += (choice.delta.content or "") if req["chat"] else choice.text
            finish = choice.finish_reason or finish
        if req["cancel"] and chunks >= 3:
            stream.close()  # the client goes away mid-stream
            return {"text": text, "cancelled": True}
    return {"text": text, "completion_tokens": usage.completion_tokens, "finish": finish,
            "cached": usage.prompt_tokens_details.cached_tokens}


class Load(unittest.TestCase):
    def test_200_requests_from_32_clients(self) -> None:
        tmp = Path(tempfile.mkdtemp(prefix="msa_serve_load_"))
        try:
            model = make_model(tmp / "small", "small", seed=5)
            requests = build_requests(vocab=4096)
            started = time.monotonic()
            with Server(model, "--cache-tokens", "16384", "--max-batch", "16", "--max-queue", "64",
                        "--served-model-name", "small") as server:
                results: list = [None] * REQUESTS
                local = threading.local()

                def run(req: dict) -> None:
                    if not hasattr(local, "client"):
                        local.client = server.client(timeout=300)
                    results[req["i"]] = send(local.client, req)

                with ThreadPoolExecutor(CLIENTS) as pool:
                    for future in [pool.submit(run, req) for req in requests]:
                        future.result(timeout=600)
                loaded = time.monotonic() - started
                m = server.wait_idle(timeout=30)
                self.assertEqual(m['msa_kv_cache_pages{state="used"}'], 0, "pages leaked")
                self.assertEqual(m["msa_running_requests"], 0)
                self.assertEqual(m["msa_queue_depth"], 0)
                self.assertEqual(m["msa_requests_received_total"], REQUESTS)
                cancelled = sum(1 for r in requests if r["cancel"])
                finished = {k: m[f'msa_requests_finished_total{{reason="{k}"}}']
                            for k in ("stop", "length", "cancelled", "error")}
                self.assertEqual(finished["error"], 0)
                self.assertEqual(finished["cancelled"], cancelled)
                self.assertEqual(finished["stop"] + finished["length"], REQUESTS - cancelled)
                self.assertGreater(m["msa_prompt_tokens_cached_total"], 0, "the prefix cache was not used")
                cached_pages = m['msa_kv_cache_pages{state="cached"}']

            # The same requests alone: batch 1, no prefix cache, one at a time.
            with Server(model, "--cache-tokens", "16384", "--max-batch", "1", "--no-prefix-cache",
                        "--served-model-name", "small") as alone_server:
                client = alone_server.client(timeout=300)
                mismatches = []
                for req in requests:
                    if req["cancel"]:
                        continue
                    alone = send(client, dict(req, stream=False))
                    got = results[req["i"]]
                    if (got["text"], got["completion_tokens"], got["finish"]) != (
                            alone["text"], alone["completion_tokens"], alone["finish"]):
                        mismatches.append((req["i"], got, alone))
                self.assertEqual(mismatches, [], f"{len(mismatches)} answers differ from the same request alone")
            hits = sum(1 for r in results if r.get("cached"))
            print(f"\nload: {REQUESTS} requests ({cancelled} cancelled mid-stream) from {CLIENTS} clients in "
                  f"{loaded:.1f} s; {hits} took prefix-cache pages ({int(m['msa_prompt_tokens_cached_total'])} "
                  f"prompt tokens; {int(cached_pages)} pages cached at the end); 0 used pages afterwards; "
                  f"{REQUESTS - cancelled} answers equal to the same request alone; total "
                  f"{time.monotonic() - started:.1f} s", file=sys.stderr)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
