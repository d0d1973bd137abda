"""A stand-in SGLang server: SGLang's HTTP formats, transformers' Qwen3-MoE behind them (SGLang does not run here).

Legend: P prompt tokens, G generated tokens, X MoE layers, K experts per token.

It speaks what ``titan_foremoe/rollouts/engines/sglang_server.py`` documents from SGLang's source (file @ commit
there): ``POST /generate`` with ``input_ids``, ``sampling_params`` (``max_new_tokens``, ``temperature`` (0:
greedy), ``top_p``, ``sampling_seed``), ``return_logprob``, ``logprob_start_len`` (-1: output tokens only),
``return_routed_experts``, ``routed_experts_start_len``; it answers ``{"output_ids", "meta_info"}`` (a
``--skip-tokenizer-init`` server) with ``output_token_logprobs`` / ``input_token_logprobs`` as ``[logprob, id,
null]`` (the first input entry's logprob null), log-probs ``log_softmax(logits / temperature)`` before top-p,
``finish_reason`` ``{"type": "stop" | "length", ...}``, and ``routed_experts``: base64 of the raw int32 bytes of
``[P + G - 1 - start, X, K]``. ``POST /update_weights_from_disk`` answers ``{"success", "message",
"num_paused_requests"}`` (HTTP 400 on failure); ``/flush_cache`` answers plain text; ``GET /health``,
``GET /get_model_info``; ``/init_weights_update_group`` joins the trainer's group (gloo only here: no GPU) and
``/update_weights_from_distributed`` receives the named tensors by broadcast in order (or, with ``load_format``
``"flattened_bucket"``, one uint8 broadcast of their bytes back to back, split by their dtypes and shapes) and
loads them by name.

Behind it, transformers' ``Qwen3MoeForCausalLM`` in fp32 decodes (a full forward per token: the model is tiny)
and its router's top-k of every fed token are the routes. ``fault`` corrupts the next answers (the malformed
responses a client must refuse): ``"short_routes"`` drops one position's routes, ``"extra_layer"`` ships one
layer too many, ``"no_routes"`` leaves them out, ``"short_logprobs"`` drops the last output log-prob.
"""

from __future__ import annotations

import base64
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import torch


class SGLangStandIn:
    """``start()`` serves on 127.0.0.1 and a free port (a daemon thread); ``calls`` records (path, body)."""

    def __init__(self, folder: str):
        self.lock = threading.Lock()
        self.calls: list[tuple[str, dict]] = []
        self.fault: str | None = None
        self.version = 0
        self.groups: dict = {}  # group name -> the gloo group joined by /init_weights_update_group
        self.buckets: list = []  # [group name, the names] of each flattened bucket received, in order
        self.loaded: dict[str, torch.Tensor] = {}  # every tensor received by update, as it arrived (bit-exact)
        self._load(folder)
        self.httpd: ThreadingHTTPServer | None = None

    def _load(self, folder: str) -> None:
        from transformers import GenerationConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        try:
            eos = GenerationConfig.from_pretrained(folder).eos_token_id
        except OSError:
            eos = model.config.eos_token_id
        self.model, self.folder = model, folder
        from safetensors import safe_open

        self.checkpoint_names = set()  # the folder's tensor names (SGLang loads checkpoint names, e.g. per expert)
        for f in os.listdir(folder):
            if f.endswith(".safetensors"):
                with safe_open(os.path.join(folder, f), "pt") as st:
                    self.checkpoint_names.update(st.keys())
        self.eos = set(eos if isinstance(eos, list) else [eos]) - {None}

    # -- the engine -----------------------------------------------------------------
    @torch.no_grad()
    def _routes_and_logits(self, seq: list[int]) -> tuple[np.ndarray, torch.Tensor]:
        """The router top-k ``[len(seq), X, K]`` and logits ``[len(seq), V]`` of a forward over ``seq``."""
        out = self.model(torch.tensor([seq]), output_router_logits=True)
        k = self.model.config.num_experts_per_tok
        top = torch.stack([r.view(len(seq), -1).topk(k, -1).indices for r in out.router_logits], 1)
        return top.numpy().astype(np.int32), out.logits[0].float()

    @torch.no_grad()
    def generate(self, body: dict) -> dict:
        ids = [int(t) for t in body["input_ids"]]
        sp = body.get("sampling_params") or {}
        max_new = int(sp.get("max_new_tokens", 128))
        temp, top_p = float(sp.get("temperature", 1.0)), float(sp.get("top_p", 1.0))
        greedy = temp < 1e-6  # SGLang: temperature 0 -> top_k 1 at temperature 1
        temp = 1.0 if greedy else temp
        gen = torch.Generator().manual_seed(int(sp.get("sampling_seed") or 0))
        out_ids, out_lp, finish = [], [], {"type": "length", "length": max_new}
        for _ in range(max_new):
            logits = self.model(torch.tensor([ids + out_ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits / temp, -1)
            if greedy:
                tok = int(logits.argmax())
            else:
                p_sorted, order = logp.exp().sort(descending=True)
                p_sorted[(p_sorted.cumsum(-1) - p_sorted) > top_p] = 0  # keep the top-p prefix
                tok = int(order[torch.multinomial(p_sorted / p_sorted.sum(), 1, generator=gen)])
            out_ids.append(tok)
            out_lp.append(float(logp[tok]))
            if tok in self.eos:
                finish = {"type": "stop", "matched": tok}
                break
        seq = ids + out_ids
        routes, logits = self._routes_and_logits(seq[:-1])  # the fed tokens: all but the last
        meta = {"id": f"standin-{len(self.calls)}", "finish_reason": finish, "prompt_tokens": len(ids),
                "completion_tokens": len(out_ids), "cached_tokens": 0, "weight_version": str(self.version)}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[v, t, None] for v, t in zip(out_lp, out_ids)]
            start = body.get("logprob_start_len", -1)
            start = -1 if start is None else int(start)
            if start >= 0:
                lp = torch.log_softmax(logits, -1)
                vals = [None] + [float(lp[t - 1, ids[t]]) for t in range(start + 1, len(ids))]
                meta["input_token_logprobs"] = [[v, ids[t], None] for v, t in zip(vals, range(start, len(ids)))]
        if body.get("return_routed_experts"):
            routes = routes[int(body.get("routed_experts_start_len") or 0):]
            if self.fault == "short_routes":
                routes = routes[:-1]
            elif self.fault == "extra_layer":
                routes = np.concatenate([routes, routes[:, :1]], axis=1)
            if self.fault != "no_routes":
                meta["routed_experts"] = base64.b64encode(np.ascontiguousarray(routes, np.int32).tobytes()).decode()
        if self.fault == "short_logprobs" and "output_token_logprobs" in meta:
            meta["output_token_logprobs"] = meta["output_token_logprobs"][:-1]
        return {"output_ids": out_ids, "meta_info": meta}

    def update_weights_from_disk(self, body: dict) -> tuple[int, dict]:
        try:
            self._load(str(body["model_path"]))
        except (OSError, ValueError, KeyError) as e:
            return 400, {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": 0}
        self.version += 1
        return 200, {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0}

    def init_weights_update_group(self, body: dict) -> tuple[int, dict]:
        """Join the trainer's group as rank ``rank_offset`` (one worker) over a ``tcp://`` rendezvous; gloo here
        (SGLang's workers take ``backend`` from the request the same way)."""
        import datetime

        from torch.distributed import PrefixStore, ProcessGroupGloo, TCPStore

        if body.get("backend") != "gloo":
            return 400, {"success": False, "message": f"the stand-in joins gloo groups only, not {body.get('backend')}"}
        timeout = datetime.timedelta(seconds=30)
        store = TCPStore(body["master_address"], int(body["master_port"]), int(body["world_size"]), False,
                         timeout=timeout)
        self.groups[body.get("group_name", "weight_update_group")] = ProcessGroupGloo(
            PrefixStore(body.get("group_name", "weight_update_group"), store), int(body["rank_offset"]),
            int(body["world_size"]), timeout)
        return 200, {"success": True, "message": "Succeeded to initialize custom process group."}

    def update_weights_from_distributed(self, body: dict) -> tuple[int, dict]:
        """Receive every tensor (in the order named) from rank 0, then load them by name."""
        import torch.distributed as dist

        group = self.groups.get(body.get("group_name", "weight_update_group"))
        if group is None:
            return 400, {"success": False, "message": "no such group: call /init_weights_update_group first"}
        received = {}
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        if body.get("load_format") == "flattened_bucket":  # one uint8 broadcast, the tensors' bytes in order
            empties = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in
                       zip(body["dtypes"], body["shapes"])]
            flat = torch.empty(sum(t.numel() * t.element_size() for t in empties), dtype=torch.uint8)
            group.broadcast([flat], opts).wait()
            at = 0
            for name, t in zip(body["names"], empties):
                n = t.numel() * t.element_size()
                received[name] = flat[at: at + n].view(t.dtype).reshape(t.shape)
                at += n
            self.buckets.append([body.get("group_name", "weight_update_group"), list(body["names"])])
        else:
            for name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
                buf = torch.empty(shape, dtype=getattr(torch, dtype))
                group.broadcast([buf], opts).wait()
                received[name] = buf
        params = dict(self.model.named_parameters())
        unknown = sorted(set(received) - set(params) - self.checkpoint_names)
        if unknown:
            return 400, {"success": False, "message": f"Failed to update weights: unknown {unknown[:3]}"}
        with torch.no_grad():
            for name, t in received.items():
                if name in params:  # a checkpoint-only name (transformers fuses experts) is kept, not loaded
                    params[name].copy_(t)
                self.loaded[name] = t.clone()
        self.version += 1
        return 200, {"success": True, "message": "Succeeded to update parameter online."}

    # -- HTTP -----------------------------------------------------------------------
    def handle(self, method: str, path: str, body: dict) -> tuple[int, object]:
        with self.lock:
            self.calls.append((path, body))
            if path == "/health" and method == "GET":
                return 200, ""
            if path == "/get_model_info" and method == "GET":
                return 200, {"model_path": self.folder, "is_generation": True, "weight_version": str(self.version)}
            if path == "/flush_cache":
                return 200, "Cache flushed.\nPlease check backend logs for more details.\n"
            if path == "/update_weights_from_disk" and method == "POST":
                return self.update_weights_from_disk(body)
            if path == "/init_weights_update_group" and method == "POST":
                return self.init_weights_update_group(body)
            if path == "/update_weights_from_distributed" and method == "POST":
                return self.update_weights_from_distributed(body)
            if path == "/generate" and method == "POST":
                if not isinstance(body.get("input_ids"), list):
                    return 400, {"error": {"message": "input_ids (a list of token ids) is required"}}
                return 200, self.generate(body)
        return 404, {"detail": "Not Found"}

    def start(self) -> str:
        return self.start_on(0)

    def start_on(self, port: int) -> str:
        """Serve on 127.0.0.1:``port`` (0: a free one); returns the URL."""
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self, method):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else {}
                code, out = standin.handle(method, self.path, body)
                raw = out.encode() if isinstance(out, str) else json.dumps(out).encode()
                self.send_response(code)
                self.send_header("Content-Type", "text/plain" if isinstance(out, str) else "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self):
                self._serve("GET")

            def do_POST(self):
                self._serve("POST")

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        if self.httpd is not None:
            self.httpd.shutdown()
            self.httpd.server_close()


def main(argv=None) -> None:
    """Serve the stand-in as a user-run engine: ``python tests/sglang_standin.py --model-path DIR [--port N]``."""
    import argparse
    import time

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", required=True)
    p.add_argument("--port", type=int, default=30000)
    args = p.parse_args(argv)
    standin = SGLangStandIn(args.model_path)
    url = standin.start_on(args.port)
    print(f"SGLang stand-in serving {args.model_path} at {url}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
