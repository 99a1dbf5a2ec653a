"""`msa serve --tp N` (in-process tensor-parallel ranks on the CPU) answers like `msa serve`: the
same greedy completions, one at a time and several at once, over raw HTTP (the standard
library only), on the made tiny-tp model (4 KV heads, 8 experts).

Run: MSA_CLI=build/tools/msa python3 -m unittest -v tests/serve/test_tp.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import threading
import unittest
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_util import Server, make_model  # noqa: E402

PROMPTS = [[5, 17, 99, 200, 301, 7, 8], list(range(3, 93)), [44] * 3, "hello brave new world"]


def complete(server: Server, prompt, max_tokens: int) -> dict:
    status, _, body = server.request("POST", "/v1/completions",
                                     {"model": "m", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    assert status == 200, body
    return json.loads(body)


def complete_all(server: Server, at_once: bool) -> list[dict]:
    """Every prompt's completion, one after another or all at once (one thread each)."""
    results: list[dict | None] = [None] * len(PROMPTS)

    def one(i: int) -> None:
        results[i] = complete(server, PROMPTS[i], 6 + 3 * i)

    if not at_once:
        for i in range(len(PROMPTS)):
            one(i)
        return results
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def answer(result: dict) -> tuple:
    """What must not depend on the ranks (cached_tokens depends on what ran before: the second
    round of the same prompts hits the prefix cache)."""
    usage = result["usage"]
    return (result["choices"][0]["text"], result["choices"][0]["finish_reason"], usage["prompt_tokens"],
            usage["completion_tokens"])


class ServeTp(unittest.TestCase):
    def test_tp_answers_what_one_rank_answers(self) -> None:
        tmp = Path(tempfile.mkdtemp(prefix="msa_serve_tp_"))
        try:
            model = make_model(tmp / "tiny-tp", "tiny-tp", seed=5)
            flags = ("--cache-tokens", "512", "--chunk", "32")
            with Server(model, *flags) as one:
                want = complete_all(one, at_once=False)
            for tp in (2, 4):
                with Server(model, *flags, "--tp", str(tp)) as many:
                    self.assertIn(f"cpu, {tp} ranks x 1 threads", many.output())
                    for at_once in (False, True):
                        got = complete_all(many, at_once)
                        for i in range(len(PROMPTS)):
                            self.assertEqual(answer(got[i]), answer(want[i]), f"--tp {tp}, prompt {i}, at once {at_once}")
                    m = many.wait_idle()
                    self.assertEqual(m['msa_kv_cache_pages{state="used"}'], 0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def test_fp8_cache_with_and_without_tp(self) -> None:
        """--cache-dtype fp8: every rank quantizes its own heads' K/V per (token, head), so the
        ranks hold the single model's codes and answer what it answers."""
        tmp = Path(tempfile.mkdtemp(prefix="msa_serve_fp8_"))
        try:
            model = make_model(tmp / "tiny-tp", "tiny-tp", seed=5)
            flags = ("--cache-tokens", "512", "--chunk", "32", "--cache-dtype", "fp8")
            with Server(model, *flags) as one:
                want = complete_all(one, at_once=False)
            with Server(model, *flags, "--tp", "2") as many:
                got = complete_all(many, at_once=True)
                for i in range(len(PROMPTS)):
                    self.assertEqual(answer(got[i]), answer(want[i]), f"fp8 cache, --tp 2, prompt {i}")
                self.assertEqual(many.wait_idle()['msa_kv_cache_pages{state="used"}'], 0)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
