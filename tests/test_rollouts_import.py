"""Importing engine rollouts: every format round-trips our own rollouts, an independent engine's
routes (transformers' Qwen3-MoE) import exactly, and every bad input is refused with its sample and field."""

from __future__ import annotations

import base64
import copy
import json

import numpy as np
import pytest
import torch

from titan_foremoe.rollouts import FORMATS, ModelSpec, RolloutError, RolloutStore, import_rollouts
from titan_foremoe.rollouts.__main__ import main as cli
from titan_foremoe.rollouts.export import samples_from_rollout, write_engine_file
from titan_foremoe.rollouts.formats import read_sglang, read_verl, read_vllm, write_sglang, write_verl, write_vllm

SPEC = ModelSpec(num_layers=4, top_k=2, num_experts=8, vocab_size=64)


@pytest.fixture(scope="module")
def samples():
    """Our own embedded rollout of the debug model: 2 prompts x 2 samples, routes recorded."""
    from titan_foremoe.config import load_config
    from titan_foremoe.config.validate import model_args
    from titan_foremoe.distributed.parallelize import build_model
    from titan_foremoe.rollouts.generate import GenerationConfig, generate

    cfg = load_config(None, ["--model.expert_dtype=float32"])
    torch.manual_seed(0)
    model = build_model(cfg, model_args(cfg, vocab_size=64), None, torch.device("cpu"))
    prompts = [[1, 5, 6, 7]] * 2 + [[1, 8, 9, 10, 11]] * 2
    r = generate(model, prompts, GenerationConfig(max_new_tokens=6, temperature=1.5), eos_id=63, pad_id=0,
                 num_experts=8, generator=torch.Generator().manual_seed(0))
    return samples_from_rollout(r, answers=["567", "567", "891011", "891011"], groups=["a", "a", "b", "b"])


def _rows(path):
    st = RolloutStore(path)
    return [st.read(i) for i in range(st.rows)]


def _same(rows, samples):
    assert len(rows) == len(samples)
    for row, s in zip(rows, samples):
        assert np.array_equal(row.tokens_T, s.tokens_T) and row.prompt_len == s.prompt_len
        assert np.array_equal(row.routes_RXK, s.routes_RXK)
        assert np.array_equal(row.logprobs_T, s.logprobs_T, equal_nan=True)
        assert row.answer == s.answer


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("ext", ["jsonl", "parquet"])
def test_round_trip(tmp_path, samples, fmt, ext):
    write_engine_file(fmt, samples, tmp_path / f"in.{ext}", samples_per_prompt=2)
    rep = import_rollouts(fmt, [tmp_path / f"in.{ext}"], tmp_path / "out", SPEC, rows_per_shard=3)
    assert (rep.rows, rep.groups, rep.skipped_samples) == (4, 2, 0)
    rows = _rows(tmp_path / "out")
    _same(rows, samples)
    assert [r.group for r in rows] == [0, 0, 1, 1]
    assert rows[0].routes_RXK.dtype == np.uint8
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert len(index["shards"]) == 2 and index["route_bytes_per_token"] == 4 * 2 * 1


def test_route_bytes_per_token_at_real_sizes(tmp_path):
    from titan_foremoe.rollouts import RolloutWriter

    qwen = RolloutWriter(tmp_path / "q", ModelSpec(48, 8, 128)).close()
    big = RolloutWriter(tmp_path / "d", ModelSpec(58, 8, 300)).close()
    assert (qwen["route_dtype"], qwen["route_bytes_per_token"]) == ("uint8", 384)
    assert (big["route_dtype"], big["route_bytes_per_token"]) == ("int16", 58 * 8 * 2)


def test_hf_qwen3_moe_routes_import_exactly(tmp_path):
    """An engine we did not write: transformers' Qwen3-MoE generates; its router logits give the routes,
    packed here the way vLLM (int32 [P+G-1, L, K]) and SGLang (flat int32 base64) ship them."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                         num_experts_per_tok=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg).eval()
    prompt = torch.tensor([[1, 5, 6, 7, 8]])
    with torch.no_grad():
        seq = model.generate(prompt, max_new_tokens=6, min_new_tokens=6, do_sample=True, pad_token_id=0)[0]
        out = model(seq[None, :-1], output_router_logits=True)  # the tokens fed to the model: all but the last
    P, T = prompt.shape[1], len(seq)
    routes = torch.stack([r.topk(2, dim=-1).indices for r in out.router_logits], dim=1).numpy().astype(np.int32)
    assert routes.shape == (T - 1, 2, 2)
    logp = torch.log_softmax(out.logits[0].float(), -1)[torch.arange(T - 1), seq[1:]].numpy()
    spec = ModelSpec(2, 2, 8, 64)
    vllm = {"prompt_token_ids": seq[:P].tolist(),
            "outputs": [{"token_ids": seq[P:].tolist(), "routed_experts": routes.tolist(),
                         "logprobs": [{str(int(t)): {"logprob": float(v)}} for t, v in zip(seq[P:], logp[P - 1:])]}],
            "answer": "x"}
    sglang = {"input_ids": seq[:P].tolist(), "output_ids": seq[P:].tolist(), "answer": "x",
              "meta_info": {"routed_experts": base64.b64encode(routes.tobytes()).decode(),
                            "output_token_logprobs": [[float(v), int(t), "?"] for t, v in zip(seq[P:], logp[P - 1:])]}}
    for fmt, rec in [("vllm", vllm), ("sglang", sglang)]:
        (tmp_path / f"{fmt}.jsonl").write_text(json.dumps(rec) + "\n")
        import_rollouts(fmt, [tmp_path / f"{fmt}.jsonl"], tmp_path / fmt, spec)
        (row,) = _rows(tmp_path / fmt)
        assert row.tokens_T.tolist() == seq.tolist() and row.prompt_len == P
        assert np.array_equal(row.routes_RXK, routes)
        np.testing.assert_allclose(row.logprobs_T[P:], logp[P - 1:], rtol=0, atol=1e-6)
        assert np.isnan(row.logprobs_T[:P]).all()


# -- the classic misalignments -------------------------------------------------------


def _import_one(tmp_path, fmt, rec, spec=SPEC):
    (tmp_path / "bad.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(RolloutError) as e:
        import_rollouts(fmt, [tmp_path / "bad.jsonl"], tmp_path / "out", spec)
    assert "bad.jsonl line 1" in e.value.where
    return e.value


def test_vllm_route_covering_the_last_token_is_refused(tmp_path, samples):
    rec = write_vllm(samples[:1])
    rec["outputs"][0]["routed_experts"].append([[0, 1]] * 4)  # T rows: one for the never-fed last token
    err = _import_one(tmp_path, "vllm", rec)
    assert err.field == "routes" and "expected" in err.problem and "the last token has none" in err.problem


def test_vllm_split_layout_off_by_one_is_refused(tmp_path, samples):
    rec = write_vllm(samples[:1], split=True)
    s = samples[0]
    rec["outputs"][0]["routed_experts"] = s.routes_RXK[s.prompt_len - 1:].astype(np.int32).tolist()  # gen_len rows
    err = _import_one(tmp_path, "vllm", rec)
    assert err.field == "routed_experts" and "gen_len - 1" in err.problem


@pytest.mark.parametrize("shift", [1, -1])
def test_verl_routes_shifted_by_one_position_are_refused(tmp_path, samples, shift):
    s = samples[0]
    rec = write_verl(s, prompt_width=8, response_width=8)
    routes = np.array(rec["routed_experts"])
    rec["routed_experts"] = np.roll(routes, shift, axis=0).tolist()
    err = _import_one(tmp_path, "verl", rec)
    assert err.field == "routed_experts" and "shifted" in err.problem


def test_verl_padding_rows_counted_as_routes_are_refused(tmp_path, samples):
    s = samples[0]
    rec = write_verl(s, prompt_width=8, response_width=8)
    routes = np.array(rec["routed_experts"])
    routes[:] = routes[8 - s.prompt_len]  # every row, padding included, holds a route
    rec["routed_experts"] = routes.tolist()
    assert "padding" in _import_one(tmp_path, "verl", rec).problem
    rec = write_verl(s, prompt_width=8, response_width=8)
    rec["routed_experts"] = rec["routed_experts"][1:]  # padded width without one row
    assert _import_one(tmp_path, "verl", rec).field == "routed_experts"


def test_sglang_multi_turn_with_a_missing_segment_is_refused(tmp_path, samples):
    s = samples[0]
    cut = s.prompt_len + 2
    rec = write_sglang(s, turns=[cut])
    ok = read_sglang(copy.deepcopy(rec), "x", (4, 2))[0]
    assert np.array_equal(ok.routes_RXK, s.routes_RXK)
    # turn 2 served from the prefix cache from position `cut`: position cut - 1 (turn 1's last token) never routed
    meta = rec["turns"][1]["meta_info"]
    meta["routed_experts"] = base64.b64encode(s.routes_RXK[cut:].astype(np.int32).tobytes()).decode()
    meta["routed_experts_start_len"] = cut
    err = _import_one(tmp_path, "sglang", rec)
    assert err.field == "meta_info.routed_experts_start_len" and f"positions {cut - 1}..{cut - 1} have no earlier" \
        in err.problem
    rec["turns"] = rec["turns"][::-1]
    assert "not a prefix" in _import_one(tmp_path, "sglang", rec).problem


def test_sglang_flat_payload_that_does_not_fit_is_refused(tmp_path, samples):
    rec = write_sglang(samples[0])
    raw = base64.b64decode(rec["meta_info"]["routed_experts"])
    rec["meta_info"]["routed_experts"] = base64.b64encode(raw[: -4 * 8]).decode()  # one position short
    assert "rows, expected positions" in _import_one(tmp_path, "sglang", rec).problem
    rec["meta_info"]["routed_experts"] = base64.b64encode(raw[:-4]).decode()
    assert "not a multiple" in _import_one(tmp_path, "sglang", rec).problem
    rec = write_sglang(samples[0], dtype="uint8")  # newer SGLang: routed_experts_dtype says what was sent
    assert np.array_equal(read_sglang(rec, "x", (4, 2))[0].routes_RXK, samples[0].routes_RXK)


# -- validation against the model ------------------------------------------------------


def _slime(s, **changes):
    rec = {"tokens": s.tokens_T.tolist(), "response_length": len(s.tokens_T) - s.prompt_len,
           "rollout_routed_experts": s.routes_RXK.tolist(), "label": s.answer,
           "rollout_log_probs": s.logprobs_T[s.prompt_len:].tolist()}
    rec.update(changes)
    return rec


def _set(r, idx, value):
    r = r.copy()
    r[idx] = value
    return r


@pytest.mark.parametrize("change, field, words", [
    (lambda s, r: r[:, :3], "routes", "3 layers, model has 4"),
    (lambda s, r: r[..., :1], "routes", "top-2"),
    (lambda s, r: _set(r, (2, 1, 0), 8), "routes", "out of range [0, 8) at position 2, layer 1"),
    (lambda s, r: _set(r, (3, 0), 5), "routes", "repeated expert id in the top-2 at position 3, layer 0"),
    (lambda s, r: r.astype(np.float32) + 0.5, "routes", "not an integer"),
    (lambda s, r: s.update(tokens=s["tokens"][:-1] + [64]), "tokens", "out of range [0, 64)"),
    (lambda s, r: s.update(rollout_log_probs=[-0.1]), "rollout_log_probs", "values for response_length"),
    (lambda s, r: s.update(rollout_log_probs=[0.5] * s["response_length"]), "logprobs", "<= 0"),
    (lambda s, r: s.update(reward=float("nan")), "reward", "not finite"),
    (lambda s, r: s.update(response_length=len(s["tokens"])), "response_length", ""),
])
def test_every_field_is_checked(tmp_path, samples, change, field, words):
    rec = _slime(samples[0])
    routes = change(rec, np.array(rec["rollout_routed_experts"]))
    if routes is not None:
        rec["rollout_routed_experts"] = routes.tolist()
    err = _import_one(tmp_path, "slime", rec)
    assert err.field == field and words in err.problem, str(err)


def test_skip_bad_drops_and_counts_the_whole_group(tmp_path, samples):
    recs = [_slime(s, group_index=s.group) for s in samples]
    recs[1]["rollout_routed_experts"] = recs[1]["rollout_routed_experts"][:-1]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert cli(["import", "--format", "slime", str(path), "--out", str(tmp_path / "a"),
                "--model-config", "train_configs/debug_tiny_rl.toml"]) == 2
    assert not (tmp_path / "a" / "index.json").exists()
    assert cli(["import", "--format", "slime", str(path), "--out", str(tmp_path / "b"), "--skip-bad",
                "--num-layers", "4", "--top-k", "2", "--num-experts", "8"]) == 0
    index = json.loads((tmp_path / "b" / "index.json").read_text())
    assert (index["rows"], index["skipped_samples"], index["skipped_groups"]) == (2, 2, 1)
    _same(_rows(tmp_path / "b"), samples[2:])


def test_groups_must_be_contiguous(tmp_path, samples):
    recs = [_slime(s, group_index=g) for s, g in zip(samples, ["a", "b", "a", "c"])]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    with pytest.raises(RolloutError, match="appears again"):
        import_rollouts("slime", [path], tmp_path / "out", SPEC)


def test_vllm_logprobs_must_name_the_sampled_token(samples):
    rec = write_vllm(samples[:1])
    rec["outputs"][0]["logprobs"][0] = {"999": {"logprob": -1.0}}
    with pytest.raises(RolloutError, match="no entry for the sampled token"):
        read_vllm(rec, "x", (4, 2))
    rec = write_verl(samples[0], 8, 8)
    rec["attention_mask"][10] = 0  # a hole in the response
    with pytest.raises(RolloutError, match="one run"):
        read_verl(rec, "x", (4, 2))


def test_malformed_records_name_their_line(tmp_path, samples):
    assert _import_one(tmp_path, "slime", {"tokens": None}).problem == "missing"
    assert "not a verl record" in _import_one(tmp_path, "verl", {"input_ids": [1, 2], "attention_mask": [1, 1],
                                                                 "prompt_length": "x"}).problem
    (tmp_path / "bad.jsonl").write_text("[1, 2]\n")
    with pytest.raises(RolloutError, match="line 1: json: expected an object"):
        import_rollouts("slime", [tmp_path / "bad.jsonl"], tmp_path / "out", SPEC)


def test_consecutive_single_completion_records_form_one_group(tmp_path, samples):
    recs = []
    for s in samples:  # OpenAI-server style: one request (n = 1) per sample, no group field
        rec = write_vllm([s])
        rec.pop("answer", None)
        recs.append(rec)
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    import_rollouts("vllm", [path], tmp_path / "out", SPEC)
    assert [r.group for r in _rows(tmp_path / "out")] == [0, 0, 1, 1]


def test_a_skipped_record_between_two_runs_of_one_prompt_leaves_two_groups(tmp_path, samples):
    """Without group ids, a prompt's samples seen again after a skipped record are a new group, as reported."""
    recs = [json.dumps(_slime(s)) for s in samples[:2]]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([*recs, "{}", *recs]) + "\n")  # "{}": not a slime record, skipped
    rep = import_rollouts("slime", [path], tmp_path / "out", SPEC, skip_bad=True)
    assert (rep.rows, rep.groups, rep.skipped_groups) == (4, 2, 1)
    assert [r.group for r in _rows(tmp_path / "out")] == [0, 0, 1, 1]


@pytest.mark.parametrize("fmt", ["verl", "slime"])
def test_multi_turn_loss_mask_round_trips(tmp_path, samples, fmt):
    """A per-token loss mask (0 on a tool turn inside the completion) is written by the format's own field
    (verl ``response_mask``, slime ``loss_mask``) and comes back from the rollout directory unchanged."""
    masked = []
    for s in samples:
        m = np.arange(len(s.tokens_T)) >= s.prompt_len
        m[s.prompt_len + 1 : s.prompt_len + 3] = False
        masked.append(copy.copy(s))
        masked[-1].loss_mask_T = m
    write_engine_file(fmt, masked, tmp_path / "in.jsonl", samples_per_prompt=2)
    import_rollouts(fmt, [tmp_path / "in.jsonl"], tmp_path / "out", SPEC)
    rows = _rows(tmp_path / "out")
    _same(rows, masked)
    for row, s in zip(rows, masked):
        assert np.array_equal(row.loss_mask_T, s.loss_mask_T)


def test_physical_expert_ids_are_refused_or_mapped_to_logical(tmp_path, samples):
    """An engine-side EPLB with 4 redundant slots reports physical ids 0..11 for 8 experts: refused with a hint,
    imported exactly with the physical-to-logical map (the CLI's --expert-map)."""
    phys_to_log = np.array([0, 1, 2, 3, 4, 5, 6, 7, 3, 5, 0, 6])  # slots 8..11 replicate experts 3, 5, 0, 6
    log_to_phys = {3: 8, 5: 9, 0: 10, 6: 11}
    physical = []
    for s in samples:
        p = copy.copy(s)
        p.routes_RXK = np.vectorize(lambda e: log_to_phys.get(int(e), int(e)))(s.routes_RXK)
        physical.append(p)
    assert any((p.routes_RXK >= 8).any() for p in physical)
    write_engine_file("slime", physical, tmp_path / "in.jsonl", samples_per_prompt=2)
    with pytest.raises(RolloutError, match="out of range .* engine-side EPLB"):
        import_rollouts("slime", [tmp_path / "in.jsonl"], tmp_path / "a", SPEC)
    (tmp_path / "map.json").write_text(json.dumps(phys_to_log.tolist()))
    assert cli(["import", "--format", "slime", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "b"),
                "--num-layers", "4", "--top-k", "2", "--num-experts", "8", "--vocab-size", "64",
                "--expert-map", str(tmp_path / "map.json")]) == 0
    _same(_rows(tmp_path / "b"), samples)
