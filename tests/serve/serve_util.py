"""Helpers of the `msa serve` tests: the msa binary, made models, a server process that always
ends, and raw HTTP (urllib) for what the openai client hides (status codes, headers, bad bytes).

The server listens on port 0 (the kernel picks a free port; the server prints it), so tests
never race for ports; it runs with --threads 1 (on a shared 2-core machine, OpenMP barriers
between 2 threads wait for the other engineer's processes and make a tiny model 1000x slower).
Every server is stopped with SIGTERM, then SIGKILL, by its process id, in a finally block and
at interpreter exit.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

MSA = os.environ.get("MSA_CLI", "msa")
_servers: list["Server"] = []


def run_msa(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([MSA, *args], capture_output=True, timeout=timeout, check=False)


def make_model(directory: Path, preset: str = "tiny", seed: int = 0) -> Path:
    result = run_msa("make-model", "--config", preset, "--out", str(directory), "--seed", str(seed), "--force")
    if result.returncode != 0:
        raise RuntimeError(f"make-model failed: {result.stderr.decode(errors='replace')}")
    return directory


class Server:
    """`msa serve --model DIR --port 0 ...`, as a context manager."""

    def __init__(self, model: Path, *extra: str, start_timeout: float = 120):
        self.log = tempfile.NamedTemporaryFile(prefix="msa_serve_", suffix=".log", delete=False)
        args = [MSA, "serve", "--model", str(model), "--port", "0", "--threads", "1", *extra]
        self.process = subprocess.Popen(args, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        _servers.append(self)
        deadline = time.monotonic() + start_timeout
        self.port = None
        while time.monotonic() < deadline:
            text = Path(self.log.name).read_text(errors="replace")
            match = re.search(r"listening on http://[^:]+:(\d+)", text)
            if match:
                self.port = int(match.group(1))
                break
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        if self.port is None:
            self.stop()
            raise RuntimeError(f"msa serve did not start: {Path(self.log.name).read_text(errors='replace')}")
        self.base = f"http://127.0.0.1:{self.port}"
        key = extra[extra.index("--api-key") + 1] if "--api-key" in extra else None
        self.auth = {"Authorization": f"Bearer {key}"} if key else {}

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        """Stops the server; raises when it had crashed or did not exit cleanly (a sanitizer
        report in the ASan build ends it with SIGABRT)."""
        killed = False
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=15)
                killed = True
        self.log.close()
        if killed or self.process.returncode != 0:
            if getattr(self, "_reported", False):
                return
            self._reported = True
            tail = "\n".join(self.output().splitlines()[-40:])
            raise AssertionError(f"msa serve ended with {'SIGKILL after 30 s' if killed else self.process.returncode}:"
                                 f"\n{tail}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def client(self, **kwargs):
        import openai

        kwargs.setdefault("api_key", "none")
        kwargs.setdefault("timeout", 120)
        kwargs.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.base + "/v1", **kwargs)

    def request(self, method: str, path: str, body: bytes | str | dict | None = None, headers: dict | None = None,
                timeout: float = 60):
        """(status, headers, body bytes) of one raw HTTP request."""
        if isinstance(body, dict):
            body = json.dumps(body)
        if isinstance(body, str):
            body = body.encode()
        req = urllib.request.Request(self.base + path, data=body, method=method, headers=headers or {})
        if body is not None and "Content-Type" not in (headers or {}):
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as response:
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()

    def metrics(self) -> dict[str, float]:
        status, _, body = self.request("GET", "/metrics", headers=self.auth)
        assert status == 200, body
        values = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                values[name] = float(value)
        return values

    def wait_idle(self, timeout: float = 30) -> dict[str, float]:
        """Waits until no request holds a page and none runs or waits; returns the metrics."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (m['msa_kv_cache_pages{state="used"}'] == 0 and m["msa_running_requests"] == 0
                    and m["msa_queue_depth"] == 0):
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.05)


@atexit.register
def _stop_all() -> None:
    for server in _servers:
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - best effort at exit (a test reported it already)
            pass


def msa_run_text(model: Path, *args: str) -> tuple[list[int], str, int]:
    """`msa run` on the model: (generated ids, decoded text, prompt tokens)."""
    result = run_msa("run", "--model", str(model), "--threads", "1", *args)
    if result.returncode != 0:
        raise RuntimeError(result.stderr.decode(errors="replace"))
    out = result.stdout
    first, _, rest = out.partition(b"\n")
    ids = [int(x) for x in first.split()]
    text = rest[:-1] if rest.endswith(b"\n") else rest
    prompt = int(re.search(rb"prefill (\d+) tokens", result.stderr).group(1))
    return ids, text.decode("utf-8", errors="replace"), prompt
