"""Issue 46: an engine that cannot serve is named for what it is (connection refused, timed out, not a vLLM
answer, no worker extension), at the pre-flight for an engine the user runs, and at run time."""

from __future__ import annotations

import json
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest


def serve(answers: dict[str, tuple[int, str]]):
    """A local HTTP server answering ``answers[path] = (status, body)`` (404 elsewhere); its URL."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self):
            status, body = answers.get(self.path, (404, '{"detail": "Not Found"}'))
            self.send_response(status)
            self.end_headers()
            self.wfile.write(body.encode())

        do_GET = do_POST = _answer

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_each_cause_has_its_own_line():
    from titan_foremoe.rollouts.engines.engine_probe import probe
    from titan_foremoe.rollouts.engines.errors import EngineError

    with pytest.raises(EngineError, match=r"^vLLM at http://127\.0\.0\.1:\d+ is unreachable: connection refused"):
        probe(f"http://127.0.0.1:{closed_port()}", 5, extension=True)
    html, url = serve({"/version": (200, "<!DOCTYPE html><html><body>login</body></html>")})
    with pytest.raises(EngineError, match=r"/version answered an HTML page .*not a vLLM answer"):
        probe(url, 5, extension=True)
    html.shutdown()
    plain, url = serve({"/version": (200, '{"version": "0.28.0"}')})  # vLLM without our extension
    with pytest.raises(EngineError, match=r"has no FusedExpertLoad worker extension.*HTTP 404"):
        probe(url, 5, extension=True)
    probe(url, 5, extension=False)  # a reload sync needs no extension
    plain.shutdown()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts, never answers
    with pytest.raises(EngineError, match=r"is unreachable: timed out"):
        probe(f"http://127.0.0.1:{silent.getsockname()[1]}", 1, extension=False)
    silent.close()


def test_install_names_a_down_engine_not_a_missing_extension():
    """``weight_sync = "nccl"`` and nothing listening: it said 'has no FusedExpertLoad worker extension', the
    refused connection last in parentheses."""
    from titan_foremoe.rollouts.engines import vllm_fused_load
    from titan_foremoe.rollouts.engines.vllm_server import VLLMClient

    client = VLLMClient(f"http://127.0.0.1:{closed_port()}", timeout_s=2, retries=0)
    with pytest.raises(Exception) as e:
        vllm_fused_load.install(client.post, client.url)
    assert "connection refused" in str(e.value) and "worker extension" not in str(e.value), str(e.value)
    html, url = serve({"/collective_rpc": (200, "<html>proxy</html>"), "/version": (200, "<html>proxy</html>")})
    client = VLLMClient(url, timeout_s=2, retries=0)
    with pytest.raises(Exception) as e:
        vllm_fused_load.install(client.post, client.url)
    assert "not a vLLM answer" in str(e.value) and "worker extension" not in str(e.value), str(e.value)
    with pytest.raises(Exception, match="not a vLLM answer"):
        _ = client.api
    html.shutdown()


def test_preflight_contacts_a_user_run_engine_and_refuses_nccl_on_cpu(tmp_path):
    from titan_foremoe.config import ConfigError, load_config
    from titan_foremoe.config.preflight import check_user_engine

    def engine(*overrides):
        return load_config("train_configs/qwen3_moe_hf_vllm.toml", [f"--job.dump_folder={tmp_path}",
                                                                     *overrides]).rollout_engine

    down = f"--rollout_engine.url=http://127.0.0.1:{closed_port()}"
    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] url: vLLM at .* is unreachable: connection refused"):
        check_user_engine(engine(down))
    with pytest.raises(ConfigError, match=r"^\[rollout_engine\] weight_sync: 'nccl' needs GPUs .*device is cpu"):
        check_user_engine(engine(down, "--rollout_engine.weight_sync=nccl"))
    plain, url = serve({"/version": (200, '{"version": "0.28.0"}')})
    check_user_engine(engine(f"--rollout_engine.url={url}"))  # reachable vLLM, reload sync: fine
    plain.shutdown()
