"""`msa serve` through the official openai client (and raw HTTP for what it hides), on a tiny
made model: completions and chat, streaming and not, stop strings and ids, usage, greedy
output equal to `msa run`, the prefix cache, cancellation, the queue bound and every class of
bad input the issue names (each a 4xx with OpenAI's error object naming the field).

Run: MSA_CLI=build/tools/msa build/serve-venv/bin/python -m unittest -v tests/serve/test_protocol.py
"""

from __future__ import annotations

import http.client
import json
import shutil
import sys
import tempfile
import threading
import time
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import openai  # noqa: E402
from serve_util import Server, make_model, msa_run_text  # noqa: E402

MODEL: Path
SMALL: Path  # ~400 tokens/s on one core: slow enough to cancel a request while it runs
SERVER: Server
SLOW: Server
TMP: Path


def setUpModule() -> None:
    global MODEL, SMALL, SERVER, SLOW, TMP
    TMP = Path(tempfile.mkdtemp(prefix="msa_serve_protocol_"))
    MODEL = make_model(TMP / "tiny", "tiny", seed=3)
    SMALL = make_model(TMP / "small", "small", seed=1)
    SERVER = Server(MODEL, "--cache-tokens", "2048", "--max-batch", "8", "--served-model-name", "tiny")
    SLOW = Server(SMALL, "--cache-tokens", "8192", "--max-batch", "4")


def tearDownModule() -> None:
    SERVER.stop()
    SLOW.stop()
    shutil.rmtree(TMP, ignore_errors=True)


def error_of(status_body: tuple) -> dict:
    status, _, body = status_body
    return status, json.loads(body)["error"]


class Protocol(unittest.TestCase):
    def setUp(self) -> None:
        self.client = SERVER.client()

    def test_health_and_models(self) -> None:
        status, _, body = SERVER.request("GET", "/health")
        self.assertEqual(status, 200)
        self.assertEqual(json.loads(body)["status"], "ok")
        models = self.client.models.list()
        self.assertEqual([m.id for m in models.data], ["tiny"])

    def test_completion_equals_msa_run(self) -> None:
        for prompt in ["hello world", "the quick brown fox jumps"]:
            ids, text, prompt_tokens = msa_run_text(MODEL, "--prompt", prompt, "--max-tokens", "16")
            r = self.client.completions.create(model="tiny", prompt=prompt, max_tokens=16, temperature=0)
            self.assertEqual(r.choices[0].text, text, prompt)
            self.assertEqual(r.usage.prompt_tokens, prompt_tokens)
            self.assertEqual(r.usage.completion_tokens, len(ids))
            self.assertEqual(r.usage.total_tokens, prompt_tokens + len(ids))
            self.assertEqual(r.choices[0].finish_reason, "length" if len(ids) == 16 else "stop")
            self.assertEqual(r.object, "text_completion")

    def test_token_prompt_and_stop_token_ids(self) -> None:
        prompt = [5, 17, 99, 200, 301, 7, 8]
        ids, _, _ = msa_run_text(MODEL, "--prompt-tokens", ",".join(map(str, prompt)), "--max-tokens", "12")
        r = self.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
        self.assertEqual(r.usage.prompt_tokens, len(prompt))
        self.assertEqual(r.usage.completion_tokens, len(ids))
        stop_at = 4
        r = self.client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                           extra_body={"stop_token_ids": [ids[stop_at]]})
        self.assertEqual(r.choices[0].finish_reason, "stop")
        self.assertEqual(r.usage.completion_tokens, ids.index(ids[stop_at]) + 1)

    def test_streaming_equals_whole(self) -> None:
        whole = self.client.completions.create(model="tiny", prompt="hello there", max_tokens=20, temperature=0)
        pieces, finish, usage = [], None, None
        for chunk in self.client.completions.create(model="tiny", prompt="hello there", max_tokens=20, temperature=0,
                                                    stream=True, stream_options={"include_usage": True}):
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                pieces.append(choice.text)
                finish = choice.finish_reason or finish
        self.assertEqual("".join(pieces), whole.choices[0].text)
        self.assertEqual(finish, whole.choices[0].finish_reason)
        self.assertEqual(usage.completion_tokens, whole.usage.completion_tokens)
        self.assertEqual(usage.prompt_tokens, whole.usage.prompt_tokens)

    def test_chat_whole_and_streamed(self) -> None:
        messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
        whole = self.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
        self.assertEqual(whole.object, "chat.completion")
        self.assertEqual(whole.choices[0].message.role, "assistant")
        self.assertIsInstance(whole.choices[0].message.content, str)
        self.assertGreater(whole.usage.prompt_tokens, 5)
        pieces, roles, finish, usage = [], [], None, None
        stream = self.client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                     stream=True, stream_options={"include_usage": True})
        for chunk in stream:
            self.assertEqual(chunk.object, "chat.completion.chunk")
            if chunk.usage:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.role:
                    roles.append(choice.delta.role)
                pieces.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
        self.assertEqual(roles, ["assistant"])
        self.assertEqual("".join(pieces), whole.choices[0].message.content)
        self.assertEqual(finish, whole.choices[0].finish_reason)
        self.assertEqual(usage.total_tokens, whole.usage.total_tokens)
        # Text parts are joined; the answer is the same as for the plain string.
        parts = [{"role": "system", "content": [{"type": "text", "text": "be brief"}]},
                 {"role": "user", "content": "hello"}]
        again = self.client.chat.completions.create(model="tiny", messages=parts, max_tokens=12, temperature=0)
        self.assertEqual(again.choices[0].message.content, whole.choices[0].message.content)

    def test_stop_strings(self) -> None:
        prompt = "stop strings"
        full = self.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
        text = full.choices[0].text
        # A stop string inside the output: the text ends before its first occurrence.
        candidates = [text[i:i + 2] for i in range(2, len(text) - 2) if text[i:i + 2].isascii()
                      and text[i:i + 2].isprintable()]
        self.assertTrue(candidates, text)
        stop = candidates[0]
        expected = text[: text.index(stop)]
        for stream in (False, True):
            if stream:
                got, finish = "", None
                for chunk in self.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                            stop=[stop, "never-there"], stream=True):
                    for choice in chunk.choices:
                        got += choice.text
                        finish = choice.finish_reason or finish
            else:
                r = self.client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                                   stop=stop)
                got, finish = r.choices[0].text, r.choices[0].finish_reason
                self.assertLess(r.usage.completion_tokens, 24)
            self.assertEqual(got, expected, f"stream={stream} stop={stop!r}")
            self.assertEqual(finish, "stop")

    def test_seeded_sampling_is_reproducible(self) -> None:
        kwargs = dict(model="tiny", prompt="sampling", max_tokens=16, temperature=0.9, top_p=0.9, seed=7,
                      extra_body={"top_k": 50})
        a = self.client.completions.create(**kwargs).choices[0].text
        b = self.client.completions.create(**kwargs).choices[0].text
        self.assertEqual(a, b)

    def test_prefix_cache_reuses_whole_blocks(self) -> None:
        # The tiny model's pages hold 16 tokens: 100 tokens of a shared prefix are 6 pages.
        prompt = [(i * 37 + 11) % 500 + 3 for i in range(100)]
        first = self.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        second = self.client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0)
        self.assertEqual(second.choices[0].text, first.choices[0].text)
        self.assertEqual(second.usage.prompt_tokens_details.cached_tokens, 96)
        longer = prompt + [7, 8, 9] * 10
        third = self.client.completions.create(model="tiny", prompt=longer, max_tokens=8, temperature=0)
        self.assertGreaterEqual(third.usage.prompt_tokens_details.cached_tokens, 96)
        ids, _, _ = msa_run_text(MODEL, "--prompt-tokens", ",".join(map(str, longer)), "--max-tokens", "8")
        self.assertEqual(third.usage.completion_tokens, len(ids))
        self.assertEqual(SERVER.wait_idle()['msa_kv_cache_pages{state="used"}'], 0)

    def test_client_disconnect_frees_pages(self) -> None:
        before = SLOW.metrics()['msa_requests_finished_total{reason="cancelled"}']
        conn = http.client.HTTPConnection("127.0.0.1", SLOW.port, timeout=30)
        body = json.dumps({"prompt": "a long answer", "max_tokens": 4000, "temperature": 0, "stream": True,
                           "ignore_eos": True})
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        self.assertEqual(response.status, 200)
        response.read1(64)  # the first events
        self.assertGreater(SLOW.metrics()['msa_kv_cache_pages{state="used"}'], 0)
        conn.sock.close()
        conn.close()
        started = time.monotonic()
        m = SLOW.wait_idle(timeout=20)
        self.assertLess(time.monotonic() - started, 5)  # 4000 tokens would take ~10 s
        self.assertEqual(m['msa_kv_cache_pages{state="used"}'], 0)
        self.assertEqual(m['msa_requests_finished_total{reason="cancelled"}'], before + 1)

    def test_whole_response_client_disconnect_frees_pages(self) -> None:
        before = SLOW.metrics()['msa_requests_finished_total{reason="cancelled"}']
        conn = http.client.HTTPConnection("127.0.0.1", SLOW.port, timeout=30)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "x", "max_tokens": 4000, "ignore_eos": True,
                                                            "temperature": 0}),
                     {"Content-Type": "application/json"})
        time.sleep(0.5)
        self.assertGreater(SLOW.metrics()['msa_kv_cache_pages{state="used"}'], 0)
        conn.sock.close()
        started = time.monotonic()
        m = SLOW.wait_idle(timeout=20)
        self.assertLess(time.monotonic() - started, 5)  # the heartbeat notices within ~2 s
        self.assertEqual(m['msa_kv_cache_pages{state="used"}'], 0)
        self.assertEqual(m['msa_requests_finished_total{reason="cancelled"}'], before + 1)


class BadInput(unittest.TestCase):
    """Each refusal: a 4xx, OpenAI's error object, the field named."""

    def assert_refused(self, body, param, status=400, path="/v1/completions", headers=None, contains=None):
        got_status, error = error_of(SERVER.request("POST", path, body, headers))
        self.assertEqual(got_status, status, error)
        self.assertEqual(error["param"], param, error)
        self.assertIn("type", error)
        if contains:
            self.assertIn(contains, error["message"])
        return error

    def test_malformed_json_and_wrong_shapes(self) -> None:
        self.assert_refused('{"prompt": "x", ', None, contains="not valid JSON")
        self.assert_refused("[1, 2]", None, contains="JSON object")
        self.assert_refused("[" * 100000, None, contains="nested deeper")
        self.assert_refused({"prompt": "x", "max_tokens": "8"}, "max_tokens")
        self.assert_refused({"prompt": "x", "max_tokens": 8.5}, "max_tokens")
        self.assert_refused({"prompt": "x", "max_tokens": -1}, "max_tokens")
        self.assert_refused({"prompt": "x", "max_tokens": 10 ** 30}, "max_tokens")
        self.assert_refused({"prompt": "x", "max_tokens": 1_000_000}, "max_tokens")
        self.assert_refused({"prompt": "x", "temperature": -0.5}, "temperature")
        self.assert_refused({"prompt": "x", "top_p": 0}, "top_p")
        self.assert_refused({"prompt": "x", "seed": 1.5}, "seed")
        self.assert_refused({"prompt": "x", "stop": [1, 2]}, "stop[0]")
        self.assert_refused({"prompt": "x", "stream": "yes"}, "stream")
        self.assert_refused({"prompt": [1, 2, 100000]}, "prompt[2]")
        self.assert_refused({"prompt": ["a", "b"]}, "prompt")
        self.assert_refused({"prompt": ""}, "prompt")
        self.assert_refused({"max_tokens": 4}, "prompt")
        self.assert_refused({"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids[0]")
        self.assert_refused({"messages": "hi"}, "messages", path="/v1/chat/completions")
        self.assert_refused({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role",
                            path="/v1/chat/completions")
        self.assert_refused({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
                            "messages[0].content[0].type", path="/v1/chat/completions")

    def test_bad_utf8(self) -> None:
        self.assert_refused(b'{"prompt": "\xff\xfe"}', None, contains="not valid JSON")
        self.assert_refused(b'{"prompt": "\\ud800"}', None, contains="not valid JSON")

    def test_unknown_and_unsupported_fields(self) -> None:
        self.assert_refused({"prompt": "x", "temprature": 0.5}, "temprature", contains="unknown field")
        self.assert_refused({"prompt": "x", "n": 2}, "n")
        self.assert_refused({"prompt": "x", "logprobs": 2}, "logprobs")
        self.assert_refused({"prompt": "x", "best_of": 3}, "best_of")
        self.assert_refused({"prompt": "x", "echo": True}, "echo")
        self.assert_refused({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty")
        self.assert_refused({"prompt": "x", "logit_bias": {"5": 10}}, "logit_bias")
        chat = "/v1/chat/completions"
        msgs = [{"role": "user", "content": "hi"}]
        self.assert_refused({"messages": msgs, "logprobs": True}, "logprobs", path=chat)
        self.assert_refused({"messages": msgs, "n": 3}, "n", path=chat)
        self.assert_refused({"messages": msgs, "response_format": {"type": "json_object"}}, "response_format",
                            path=chat)
        tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
        error = self.assert_refused({"messages": msgs, "tools": tools}, "tools", path=chat)
        self.assertIn("tool-call format", error["message"])
        self.assert_refused({"messages": msgs, "tool_choice": "required"}, "tool_choice", path=chat)
        # Fields that do not change the answer are accepted.
        status, _, body = SERVER.request("POST", chat, {"messages": msgs, "max_tokens": 2, "user": "u",
                                                        "metadata": {"a": "b"}, "tools": [], "tool_choice": "none",
                                                        "parallel_tool_calls": False})
        self.assertEqual(status, 200, body)
        # And the openai client raises with the message naming the field.
        client = SERVER.client()
        with self.assertRaises(openai.BadRequestError) as raised:
            client.completions.create(model="tiny", prompt="x", n=2)
        self.assertIn("n:", str(raised.exception))

    def test_prompt_longer_than_the_cache(self) -> None:
        error = self.assert_refused({"prompt": [5] * 2048}, "prompt")
        self.assertEqual(error["code"], "context_length_exceeded")
        error = self.assert_refused({"prompt": [5] * 2000, "max_tokens": 100}, "max_tokens")
        self.assertEqual(error["code"], "context_length_exceeded")

    def test_unknown_path(self) -> None:
        status, error = error_of(SERVER.request("GET", "/v2/things"))
        self.assertEqual(status, 404)
        self.assertIn("not found", error["message"])


class Limits(unittest.TestCase):
    def test_api_key_body_limit_and_full_queue(self) -> None:
        with Server(SMALL, "--api-key", "sesame", "--max-body-bytes", "4096", "--max-batch", "1", "--max-queue",
                    "1", "--cache-tokens", "8192") as server:
            status, headers, body = server.request("POST", "/v1/completions", {"prompt": "x"})
            self.assertEqual(status, 401)
            self.assertEqual(json.loads(body)["error"]["code"], "invalid_api_key")
            with self.assertRaises(openai.AuthenticationError):
                server.client(api_key="wrong").completions.create(model="tiny", prompt="x", max_tokens=2)
            ok = server.client(api_key="sesame").completions.create(model="tiny", prompt="x", max_tokens=2)
            self.assertEqual(ok.usage.completion_tokens, 2)
            self.assertEqual(server.request("GET", "/health")[0], 200)  # open: for load balancers
            auth = {"Authorization": "Bearer sesame"}
            status, _, body = server.request("POST", "/v1/completions", {"prompt": "x" * 8000}, auth)
            self.assertEqual(status, 413, body)
            self.assertIn("--max-body-bytes", json.loads(body)["error"]["message"])

            # One running, one waiting: the third gets 503 with a retry hint.
            conns = []
            for _ in range(2):
                conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
                conn.request("POST", "/v1/completions",
                             json.dumps({"prompt": "x", "max_tokens": 3000, "ignore_eos": True, "stream": True}),
                             {"Content-Type": "application/json", **auth})
                conns.append(conn)
                time.sleep(0.3)
            status, headers, body = server.request("POST", "/v1/completions", {"prompt": "x", "max_tokens": 4}, auth)
            self.assertEqual(status, 503, body)
            self.assertEqual(headers.get("Retry-After"), "1")
            self.assertEqual(json.loads(body)["error"]["code"], "queue_full")
            for conn in conns:
                conn.close()
            m = server.wait_idle(timeout=20)
            self.assertEqual(m['msa_kv_cache_pages{state="used"}'], 0)
            self.assertEqual(m['msa_requests_rejected_total{reason="queue_full"}'], 1)


if __name__ == "__main__":
    unittest.main()
