"""A fake vLLM 0.28 HTTP engine for the fleet's hang tests (``test_fleet_hang.py``): what the fleet's HTTP client
reads, nothing more. ``/version`` 0.28; the token-in/out ``/inference/v1/generate`` answering ``[prompt[0], seed]``
with log-probs and routes of the right shapes; ``/metrics`` with vLLM's token counters (advanced per answered
sample, or by a clock: ``tick_s``) and running / waiting gauges; the sync's ``/collective_rpc`` and
``/reset_prefix_cache``. ``hang_after``: it answers that many samples, then takes requests and answers none, its
counters frozen (a wedged engine core behind a live API process) until ``release`` (then it answers what it held if
``hang_after`` was cleared). Run as a script it serves in its own process and prints its URL (a SIGSTOP then stops
everything, ``/metrics`` too). No torch import: the script starts in ~0.1 s."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np


def _routes(rows: int) -> str:
    buf = io.BytesIO()
    np.save(buf, np.zeros((rows, 1, 1), np.uint8))
    return base64.b64encode(buf.getvalue()).decode()


class FakeVLLM:
    """A fake vLLM 0.28 server on a free port (module docstring). ``tick_s``: the counters also advance by one
    every ``tick_s`` (a slow engine still decoding); ``delay_s``: each answer waits that long."""

    def __init__(self, hang_after: int | None = None, delay_s: float = 0.0, tick_s: float | None = None):
        self.hang_after, self.delay_s, self.tick_s = hang_after, delay_s, tick_s
        self.answered, self.received, self.tokens, self.t0 = 0, 0, 0, time.monotonic()
        self.lock, self.release = threading.Lock(), threading.Event()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if self.path.startswith("/metrics"):
                    return self._send(fake.metrics(self.path), "text/plain")
                self._send(json.dumps({"version": "0.28.0"}) if self.path == "/version" else "", "application/json")

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                if self.path != "/inference/v1/generate":
                    return self._send(json.dumps({"results": [None], "success": True}), "application/json")
                answer = fake.generate(body)
                if answer is not None:
                    self._send(json.dumps(answer), "application/json")

            def _send(self, text, kind):
                raw = text.encode()
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def generate(self, body: dict):
        with self.lock:
            self.received += 1
            hang = self.hang_after is not None and self.answered >= self.hang_after
            self.answered += not hang
        if hang:
            self.release.wait()  # taken, not answered until released
            if self.hang_after is not None:
                return None  # closing
            with self.lock:
                self.answered += 1
        time.sleep(self.delay_s)
        p, seed = body["token_ids"], body["sampling_params"]["seed"]
        gen = [p[0], seed]
        with self.lock:
            self.tokens += len(p) + len(gen)
        return {"choices": [{"token_ids": gen, "finish_reason": "length", "routed_experts": _routes(len(p) + 1),
                             "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": 0.0} for t in gen]}}]}

    def metrics(self, path: str) -> str:
        assert "name%5B%5D=vllm%3Ageneration_tokens_total" in path  # asked for the names it reads only
        ticks = int((time.monotonic() - self.t0) / self.tick_s) if self.tick_s else 0
        running = self.received - self.answered
        return (f'vllm:generation_tokens_total{{engine="0",model_name="m"}} {float(self.tokens + ticks)}\n'
                f'vllm:prompt_tokens_total{{engine="0",model_name="m"}} 0.0\n'
                f'vllm:num_requests_running{{engine="0",model_name="m"}} {float(running)}\n'
                f'vllm:num_requests_waiting{{engine="0",model_name="m"}} 0.0\n')

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    print(FakeVLLM().url, flush=True)
    threading.Event().wait()
