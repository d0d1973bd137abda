"""The file rollout source (single process): each rank reads only its rows, lengths are refused or
truncated by config, rewards come from the file or the configured reward, the position resumes,
and the job's config is checked against the directory before any worker starts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.validate import validate
from titan_foremoe.data.tasks import SortDigits
from titan_foremoe.data.tokenizer import CharTokenizer
from titan_foremoe.rl.rewards import resolve_reward
from titan_foremoe.rollouts import ModelSpec, RolloutError, RolloutSample, RolloutWriter
from titan_foremoe.rollouts.sources import FileSource

TOK = CharTokenizer()
SPEC = ModelSpec(4, 2, 8, 64)


def _sample(rng, digits: str, completion: str, group: int, reward=None) -> RolloutSample:
    prompt = [TOK.bos_id, *TOK.encode(f"sort:{digits}=")]
    tokens = np.array(prompt + TOK.encode(completion) + [TOK.eos_id])
    routes = np.stack([rng.permutation(8)[:2] for _ in range((len(tokens) - 1) * 4)]).reshape(-1, 4, 2)
    lp = np.full(len(tokens), np.nan, np.float32)
    lp[len(prompt):] = -0.5
    return RolloutSample(tokens, len(prompt), routes, lp, reward, "".join(sorted(digits)), str(group))


def _store(path, n_groups=8, spp=2, long_row=None, rewards=False):
    rng = np.random.default_rng(0)
    w = RolloutWriter(path, SPEC, rows_per_shard=5)
    for g in range(n_groups):
        digits = "".join(rng.choice(list("0123456789"), 4))
        for j in range(spp):
            completion = "".join(sorted(digits)) if j == 0 else digits
            if long_row == g * spp + j:
                completion = "1" * 30
            s = _sample(rng, digits, completion, g, reward=float(g) if rewards else None)
            w.add(s, g)
    w.close()
    return path


def _source(path, dp_rank=0, dp=2, rows_per_step=8, spp=2, steps=2, seq_len=24, overlong="refuse"):
    return FileSource(str(path), tokenizer=TOK, task=SortDigits(3, 6), reward_fn=resolve_reward("task"),
                      dp_rank=dp_rank, dp_degree=dp, rows_per_step=rows_per_step, samples_per_prompt=spp,
                      steps=steps, seq_len=seq_len, overlong=overlong, num_layers=4, top_k=2, num_experts=8)


def test_each_rank_reads_only_its_rows(tmp_path):
    path = _store(tmp_path / "r")
    src = _source(path, dp_rank=1)
    read = []
    orig = src.store.read
    src.store.read = lambda row: read.append(row) or orig(row)
    b0, b1 = src.next_batch(0), src.next_batch(1)
    assert read == [4, 5, 6, 7, 12, 13, 14, 15]
    assert b0.rollout.tokens_BT.shape[0] == 4 and b0.rollout.routes.experts_BTXK.dtype.itemsize == 1
    b0.rollout.routes.validate(token_lengths=b0.rollout.lengths_B, num_layers=4, top_k=2, num_experts=8)
    # the configured reward, computed from the stored answer: the sorted completion scores 1
    expected = [SortDigits().reward(_ex(b0, b), TOK.decode(b0.rollout.completion(b))) for b in range(4)]
    assert b0.rewards_B.tolist() == expected and expected[0] == expected[2] == 1.0 and expected[1] < 1
    assert b0.exact_B.tolist() == [1.0, 0.0, 1.0, 0.0] and b1.has_logprobs


def _ex(batch, b):
    from titan_foremoe.data.tasks import Example

    r = batch.rollout
    prompt = TOK.decode(r.tokens_BT[b, : int(r.prompt_lens_B[b])].tolist())
    return Example(prompt, "".join(sorted(prompt[5:-1])))


def test_stored_rewards_win_and_missing_answers_are_refused(tmp_path):
    src = _source(_store(tmp_path / "r", rewards=True))
    assert src.next_batch(0).rewards_B.tolist() == [0.0, 0.0, 1.0, 1.0]
    rng = np.random.default_rng(0)
    w = RolloutWriter(tmp_path / "none", SPEC)
    for j in range(16):
        s = _sample(rng, "4312", "1234", j // 2)
        s.answer = None
        w.add(s, j // 2)
    w.close()
    with pytest.raises(RolloutError, match="row 0: reward: neither a reward nor an answer"):
        _source(tmp_path / "none").next_batch(0)


def test_position_resumes_at_the_right_batch(tmp_path):
    path = _store(tmp_path / "r")
    a = _source(path)
    a.next_batch(0)
    state = a.state_dict()
    second = a.next_batch(1)
    b = _source(path)
    b.load_state_dict(state)
    again = b.next_batch(1)
    assert int(state["position"]) == 1
    assert np.array_equal(second.rollout.tokens_BT, again.rollout.tokens_BT)


def test_overlong_rows_are_refused_or_truncated(tmp_path):
    path = _store(tmp_path / "r", long_row=9)  # rank 0's rows of step 1 are 8..11
    with pytest.raises(RolloutError, match="row 9: tokens: .* > \\[training\\] seq_len 24"):
        _source(path)
    src = _source(path, overlong="truncate")
    assert src.next_batch(0).truncated == 0
    b = src.next_batch(1)
    assert b.truncated == 1 and int(b.rollout.lengths_B[1]) == 25 and b.rollout.routes.experts_BTXK.shape[1] == 25
    with pytest.raises(RolloutError, match="prompt of .* leaves no completion"):
        _source(path, overlong="truncate", seq_len=5).next_batch(0)


def test_groups_must_match_samples_per_prompt(tmp_path):
    with pytest.raises(RolloutError, match="samples_per_prompt does not match"):
        _source(_store(tmp_path / "r"), spp=4).next_batch(0)
    with pytest.raises(RolloutError, match="the job needs 3 steps x 8"):
        _source(tmp_path / "r", steps=3)


def test_config_is_checked_against_the_directory(tmp_path):
    path = _store(tmp_path / "r", n_groups=16, spp=4)
    base = ["--rl.rollout_source=file", "--training.steps=1", "--rl.updates_per_rollout=1",
            "--rl.sft_warmup_steps=0"]

    def check(*extra):
        return validate(load_config("train_configs/debug_tiny_rl.toml", [*base, *extra]), 4)

    check(f"--rl.rollout_dir={path}")  # 64 rows: one step of global_batch_size 64
    with pytest.raises(ConfigError, match="rollout_dir: must be set"):
        check()
    with pytest.raises(ConfigError, match="index.json not found"):
        check(f"--rl.rollout_dir={tmp_path}")
    with pytest.raises(ConfigError, match="the model has"):
        check(f"--rl.rollout_dir={path}", "--model.top_k=4")
    with pytest.raises(ConfigError, match="the job needs"):
        check(f"--rl.rollout_dir={path}", "--training.steps=2")
    with pytest.raises(ConfigError, match="row \\d+: tokens: 16 tokens = 15 input positions > \\[training\\] seq_len 12"):
        check(f"--rl.rollout_dir={path}", "--training.seq_len=12")
    check(f"--rl.rollout_dir={path}", "--training.seq_len=12", "--rl.rollout_overlong=truncate")
    # a trainer rank skips the scan of every row (its FileSource checks its own rows)
    validate(load_config("train_configs/debug_tiny_rl.toml", [*base, f"--rl.rollout_dir={path}", "--training.seq_len=12"]),
             4, scan_rollout_rows=False)
    # a shard's file missing: a config error naming it, not a traceback
    offsets = next(path.rglob("offsets*"))
    offsets.rename(offsets.with_suffix(".gone"))
    with pytest.raises(ConfigError, match="rollout_dir: .*offsets"):
        check(f"--rl.rollout_dir={path}")
    offsets.with_suffix(".gone").rename(offsets)
    index = json.loads((path / "index.json").read_text())
    del index["num_layers"]
    (path / "index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match="rollout_dir: .*index.json lacks 'num_layers'"):
        check(f"--rl.rollout_dir={path}")


class _WordTokenizer:
    """An HF-like tokenizer: two EOS ids (Qwen3's <|im_end|> and <|endoftext|>), a pad that is one of them."""

    WORDS = ["<|endoftext|>", "<|im_end|>", "q", "\\boxed{", "}", "7", "8"]
    pad_id, eos_id, eos_ids, bos_id = 0, 1, [1, 0], None

    def decode(self, ids):
        out = []
        for t in list(ids):
            if t in self.eos_ids:
                break
            out.append(self.WORDS[t])
        return "".join(out)


def test_prompt_file_scoring_and_eos_ids_match_embedded_mode(tmp_path):
    """With a prompt file (``math_exact``), file mode scores as embedded mode does: math-verify exactness
    and the format bonus; a row ending in any of the tokenizer's EOS ids is finished."""
    rng = np.random.default_rng(0)
    w = RolloutWriter(tmp_path / "r", SPEC, rows_per_shard=5)
    for completion in ([3, 5, 4, 1], [5, 0], [6, 1], [6, 6]):  # \boxed{7}, 7 (ends <|endoftext|>), 8, 88 (cut)
        tokens = np.array([2, *completion])
        routes = np.stack([rng.permutation(8)[:2] for _ in range((len(tokens) - 1) * 4)]).reshape(-1, 4, 2)
        lp = np.full(len(tokens), np.nan, np.float32)
        lp[1:] = -0.5
        s = RolloutSample(tokens, 1, routes, lp, None, "7", "0")
        w.add(s, 0)
    w.close()
    src = FileSource(str(tmp_path / "r"), tokenizer=_WordTokenizer(), task=None, reward_fn=resolve_reward("math"),
                     dp_rank=0, dp_degree=1, rows_per_step=4, samples_per_prompt=4, steps=1, seq_len=24,
                     overlong="refuse", num_layers=4, top_k=2, num_experts=8, math_exact=True, format_reward=0.1)
    b = src.next_batch(0)
    assert b.rewards_B.tolist() == pytest.approx([1.1, 1.0, 0.0, 0.0])
    assert b.exact_B.tolist() == [1.0, 1.0, 0.0, 0.0]  # "\boxed{7}" is answer 7 (not string-equal to "7")
    assert b.rollout.finished_B.tolist() == [True, True, True, False]


def test_multi_turn_loss_mask_travels_from_a_slime_file_to_the_micro_batch(tmp_path):
    """slime's ``loss_mask`` (0 on a tool turn inside the response) is stored, read and kept out of the loss;
    the tool tokens stay routed inputs. A row without a mask trains its whole completion."""
    import torch

    from titan_foremoe.rollouts import import_rollouts
    from titan_foremoe.train.rl_batches import build_micro_batch

    rng = np.random.default_rng(1)
    recs = []
    for j in range(2):
        s = _sample(rng, "4213", "1234" if j == 0 else "4321", 0)
        R = len(s.tokens_T) - s.prompt_len  # 5: four digits and the end token
        rec = {"tokens": s.tokens_T.tolist(), "response_length": R, "rollout_routed_experts": s.routes_RXK.tolist(),
               "label": s.answer}
        if j == 0:
            rec["loss_mask"] = [1, 0, 0, 1, 1]  # response tokens 1-2: a tool's output
        recs.append(rec)
    lines = [json.dumps({**rec, "group_index": f"g{k}"}) for k in range(4) for rec in recs]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    import_rollouts("slime", [tmp_path / "in.jsonl"], tmp_path / "r", SPEC)
    batch = _source(tmp_path / "r", dp=1, rows_per_step=8, steps=1).next_batch(0)
    r = batch.rollout
    P = int(r.prompt_lens_B[0])
    mb = build_micro_batch(r, [0, 1], torch.zeros(8))
    # input position p predicts token p + 1: the response's tokens P..P+4 are predicted at positions P-1..P+3
    assert mb.loss_mask_BL[0, P - 1 : P + 4].tolist() == [True, False, False, True, True]
    assert mb.loss_mask_BL[1, P - 1 : P + 4].tolist() == [True] * 5
    assert not mb.loss_mask_BL[:, : P - 1].any() and mb.token_mask_BL[0, P : P + 2].all()
    with pytest.raises(RolloutError, match="loss_mask"):
        bad = {**recs[0], "loss_mask": [1, 0]}
        (tmp_path / "bad.jsonl").write_text(json.dumps(bad) + "\n")
        import_rollouts("slime", [tmp_path / "bad.jsonl"], tmp_path / "bad", SPEC)
