"""HF folders, prompt datasets and math rewards, single process.

Config values that disagree with ``config.json``, missing or truncated weight
files, bad dataset rows (refused or skipped and counted), seeded epochs with a
resumable position, JSONL and Parquet, the chat template, math-verify rewards.
"""

from __future__ import annotations

import json
import shutil

import pytest

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.validate import validate
from titan_foremoe.data.tasks import Example
from titan_foremoe.rl.rewards import format_ok, resolve_reward

DATA = "examples/arithmetic_word_problems.jsonl"
CONFIG = "train_configs/qwen3_moe_hf_grpo.toml"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    return make_tiny_checkpoint(str(tmp_path_factory.mktemp("hf") / "tiny"), read_texts(DATA), n_layers=2)


@pytest.fixture(scope="module")
def tok(hf):
    from titan_foremoe.data.hf_tokenizer import HFTokenizer

    return HFTokenizer(hf)


def _validate(hf, *overrides, world=4):
    return validate(load_config(CONFIG, [f"--model.hf_assets_path={hf}", *overrides]), world)


def test_shape_comes_from_config_json(hf):
    r = _validate(hf)
    assert (r.n_layers, r.num_experts, r.top_k) == (2, 8, 2)


@pytest.mark.parametrize("key,value,hf_key", [
    ("n_layers", 4, "num_hidden_layers"), ("num_experts", 16, "num_experts"), ("top_k", 4, "num_experts_per_tok"),
    ("dim", 128, "hidden_size"), ("moe_hidden_dim", 64, "moe_intermediate_size"),
])
def test_config_value_disagreeing_with_checkpoint_is_refused(hf, key, value, hf_key):
    with pytest.raises(ConfigError) as e:
        _validate(hf, f"--model.{key}={value}")
    msg = str(e.value)
    assert f"[model] {key}" in msg and str(value) in msg and hf_key in msg


def test_matching_override_is_accepted(hf):
    _validate(hf, "--model.num_experts=8", "--model.top_k=2")


def test_missing_or_truncated_weight_file_names_the_file(hf, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(hf, broken)
    weights = broken / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(ConfigError, match=r"model\.safetensors is truncated"):
        _validate(str(broken))
    weights.unlink()
    (broken / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}))
    with pytest.raises(ConfigError, match="model-00001-of-00002.safetensors is missing"):
        _validate(str(broken))


def test_unsupported_architecture_is_refused(hf, tmp_path):
    tied = tmp_path / "tied"
    shutil.copytree(hf, tied)
    cfg = json.loads((tied / "config.json").read_text())
    cfg["mlp_only_layers"] = [0]
    (tied / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="dense"):
        _validate(str(tied))


def test_chat_template_and_eos(tok):
    ids = tok.chat_prompt("Tom has 3 pens.", "Solve the problem.")
    text = tok.tok.decode(ids)
    assert text.startswith("<|im_start|>system\nSolve the problem.<|im_end|>\n<|im_start|>user\nTom has 3 pens.")
    assert text.endswith("<|im_start|>assistant\n")
    assert tok.eos_ids == [tok.tok.convert_tokens_to_ids("<|im_end|>"), tok.tok.convert_tokens_to_ids("<|endoftext|>")]
    assert tok.decode(tok.encode("\\boxed{12}") + [tok.eos_id] + tok.encode("junk")) == "\\boxed{12}"


def _dataset(tok, path, **kw):
    from titan_foremoe.data.prompts import PromptDataset

    return PromptDataset(str(path), tok, max_prompt_tokens=kw.pop("max_prompt_tokens", 60), **kw)


def _rows(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_bad_rows_are_refused_naming_file_and_row_or_skipped(tok, tmp_path):
    from titan_foremoe.data.prompts import DatasetError

    good = {"prompt": "Tom has 3 pens.", "answer": "3"}
    cases = [({"answer": "3"}, "missing key 'prompt'"), ({"prompt": "  ", "answer": "3"}, "empty prompt"),
             ({"prompt": "Tom has 3 pens. " * 20, "answer": "3"}, "longer than the context")]
    for bad, message in cases:
        path = _rows(tmp_path, [good, good, bad, good])
        with pytest.raises(DatasetError, match=f"{path} row 2: .*{message}"):
            _dataset(tok, path)
        ds = _dataset(tok, path, skip_bad_rows=True)
        assert (len(ds), ds.skipped) == (3, 1)


def test_chat_message_prompts_go_through_the_template(tok, tmp_path):
    """Issue 31: a verl / OpenAI-style row (a list of {role, content}) is the template over those messages, not
    the Python repr of the list; a parquet list of structs reads the same."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    plain = {"prompt": "Tom has 3 pens.", "answer": "3"}
    chat = {"prompt": [{"role": "user", "content": "Tom has 3 pens."}], "answer": 3}
    own_system = {"prompt": [{"role": "system", "content": "Tom has pens."}, {"role": "user", "content": "3 pens."},
                             {"role": "assistant", "content": "3"}, {"role": "user", "content": "Tom has 3 pens."}],
                  "answer": "3"}
    ds = _dataset(tok, _rows(tmp_path, [plain, chat, own_system]), system_prompt="Solve the problem.", shuffle=False)
    a, b, c = ds.examples
    assert a.prompt_ids == b.prompt_ids and (b.prompt, b.answer) == ("Tom has 3 pens.", "3")
    text = tok.tok.decode(c.prompt_ids)
    assert text.startswith("<|im_start|>system\nTom has pens.<|im_end|>") and "Solve" not in text
    assert "<|im_start|>assistant\n3<|im_end|>" in text and text.endswith("<|im_start|>assistant\n")
    assert "'role'" not in text and c.prompt == "Tom has 3 pens."
    pq.write_table(pa.Table.from_pylist([chat]), tmp_path / "chat.parquet")
    parquet = _dataset(tok, tmp_path / "chat.parquet", system_prompt="Solve the problem.")
    assert parquet.examples[0].prompt_ids == a.prompt_ids


def test_non_string_prompts_and_null_values_are_named(tok, tmp_path):
    from titan_foremoe.data.prompts import DatasetError

    good = {"prompt": "Tom has 3 pens.", "answer": "3"}
    cases = [({"prompt": 5, "answer": "3"}, "'prompt' is a int \\(5\\), not a string or a list of"),
             ({"prompt": {"role": "user", "content": "x"}, "answer": "3"}, "'prompt' is a dict"),
             ({"prompt": [{"role": "user"}], "answer": "3"}, "'prompt' message 0 is a dict .* not a \\{role, content"),
             ({"prompt": ["Tom"], "answer": "3"}, "'prompt' message 0 is a str"),
             ({"prompt": [], "answer": "3"}, "empty prompt"),
             ({"prompt": "Tom has 3 pens.", "answer": None}, "'answer' is null$"),
             ({"prompt": None, "answer": "3"}, "'prompt' is null$"),
             ({"prompt": "Tom has 3 pens.", "answer": {"x": 1}}, "'answer' is a dict .*not a string or a number")]
    for bad, message in cases:
        path = _rows(tmp_path, [good, bad])
        with pytest.raises(DatasetError, match=f"{path} row 1: {message}"):
            _dataset(tok, path)
        assert _dataset(tok, path, skip_bad_rows=True).skipped == 1


def test_resume_on_another_dataset_of_the_same_size_is_refused(tok, tmp_path):
    """Issue 31: the checkpoint's model_facts.json records the prompt file's rows (count and hash of token ids); a
    file swapped at resume, even with the same row count, is refused before any worker starts."""
    from titan_foremoe.config.check import check_data_resume
    from titan_foremoe.config.preflight import dataset_facts, write_model_facts

    first = _dataset(tok, _rows(tmp_path, [{"prompt": f"Tom has {i} pens.", "answer": str(i)} for i in range(4)]))
    swapped = _dataset(tok, _rows(tmp_path, [{"prompt": f"Ann has {i} coins.", "answer": str(i)} for i in range(4)],
                                  name="other.jsonl"))
    cfg = load_config(CONFIG, [f"--job.dump_folder={tmp_path}"])
    write_model_facts(str(tmp_path / "checkpoint" / "step-3"), {}, dataset_facts(first))
    check_data_resume(cfg, first, 3)
    check_data_resume(cfg, swapped, -1)  # a fresh start reads any file
    with pytest.raises(ConfigError) as e:
        check_data_resume(cfg, swapped, 3)
    assert str(e.value).startswith(f"[data] path: {tmp_path}/checkpoint/step-3 was taken on {tmp_path}/d.jsonl "
                                   f"(4 usable rows, fingerprint {first.fingerprint()}); {tmp_path}/other.jsonl has "
                                   f"4 rows, fingerprint {swapped.fingerprint()}")
    write_model_facts(str(tmp_path / "checkpoint" / "step-3"), {})  # saved by a job without a prompt file
    check_data_resume(cfg, swapped, 3)


def test_a_line_that_is_not_an_object_is_named_by_file_and_line(tmp_path):
    """One reader (``data/records.py``) for prompt files and engine outputs: both name the file and line."""
    from titan_foremoe.data.prompts import DatasetError, read_rows
    from titan_foremoe.rollouts import RolloutError
    from titan_foremoe.rollouts.formats import iter_records

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n[1, 2]\n{"prompt": "b"\n')
    with pytest.raises(DatasetError, match=f"{path} line 3: expected an object per line, got list"):
        read_rows(str(path))
    with pytest.raises(RolloutError, match=f"{path} line 3: json: expected an object per line"):
        list(iter_records(path))
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b"\n')
    with pytest.raises(DatasetError, match=f"{path} line 2: invalid JSON"):
        read_rows(str(path))


def test_epochs_are_seeded_permutations_and_position_resumes(tok, tmp_path):
    rows = [{"prompt": f"Tom has {i} pens.", "answer": str(i)} for i in range(10)]
    path = _rows(tmp_path, rows)
    ds = _dataset(tok, path, seed=3)
    seen = []
    for _ in range(5):  # 2 ranks take 2 each per step: 20 examples, 2 epochs
        start = ds.consumed
        for rank in range(2):
            ds.consumed = start  # what rank ``rank`` sees at this position
            seen += [ex.answer for ex in ds.take(4, rank, 2)]
    assert ds.epoch == 2
    epoch0, epoch1 = seen[:10], seen[10:]
    assert sorted(epoch0) == sorted(epoch1) == sorted(str(i) for i in range(10))
    assert epoch0 != epoch1 and epoch0 != [str(i) for i in range(10)]
    assert [ex.answer for ex in _dataset(tok, path, seed=3).take(10, 0, 1)] == epoch0  # same seed, same order
    restored = _dataset(tok, path, seed=3)
    restored.load_state_dict(ds.state_dict())
    assert [ex.answer for ex in restored.take(4, 0, 1)] == [ex.answer for ex in ds.take(4, 0, 1)]


def test_sft_rows_must_fit_seq_len_inputs(tok, tmp_path):
    """``max_sft_tokens = seq_len + 1``: a row of exactly that many tokens packs into ``seq_len`` inputs; one
    more is refused at load (not by a shape error at the warm-up step)."""
    from titan_foremoe.data.prompts import DatasetError

    path = _rows(tmp_path, [{"prompt": "Tom has 3 pens.", "answer": "3"}])
    ex = _dataset(tok, path).examples[0]
    n = len(ex.prompt_ids) + len(ex.response_ids)
    ds = _dataset(tok, path, max_sft_tokens=n)
    assert ds.sft_batch(ds.examples, tok.pad_id, n - 1).inputs_BL.shape == (1, n - 1)
    with pytest.raises(DatasetError, match=f"row 0: prompt \\+ response of {n} tokens does not fit seq_len {n - 2}"):
        _dataset(tok, path, max_sft_tokens=n - 1)


def test_parquet_reads_like_jsonl(tok, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"question": f"Ann has {i} coins.", "solution": str(i)} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    a = _dataset(tok, tmp_path / "d.parquet", prompt_key="question", answer_key="solution", shuffle=False)
    b = _dataset(tok, _rows(tmp_path, rows), prompt_key="question", answer_key="solution", shuffle=False)
    assert [e.prompt_ids for e in a.examples] == [e.prompt_ids for e in b.examples]


def test_sft_batch_masks_the_prompt(tok, tmp_path):
    from titan_foremoe.data.sft import IGNORE_INDEX

    ds = _dataset(tok, _rows(tmp_path, [{"prompt": "Tom has 3 pens.", "answer": "3"}]),
                  response_template="\\boxed{{{answer}}}")
    ex = ds.examples[0]
    batch = ds.sft_batch([ex], tok.pad_id, 64)
    labels = batch.labels_BL[0][batch.labels_BL[0] != IGNORE_INDEX].tolist()
    assert labels == list(ex.response_ids) and tok.decode(labels) == "\\boxed{3}"


def test_math_reward_and_format():
    math = resolve_reward("math")
    ex = Example(prompt="", answer="14")
    assert math(None, ex, "so \\boxed{14}") == 1.0
    assert math(None, ex, "it is 14") == 1.0
    assert math(None, ex, "\\boxed{7+7}") == 1.0
    assert math(None, ex, "\\boxed{15}") == 0.0 and math(None, ex, "") == 0.0
    assert format_ok("x \\boxed{3}") and not format_ok("3") and not format_ok("\\boxed{}")


def test_config_check_reports_bad_rows_before_workers(hf, tmp_path, capsys):
    from titan_foremoe.config.check import main

    path = _rows(tmp_path, [{"prompt": "Tom has 3 pens.", "answer": "3"}, {"prompt": "Tom"}])
    code = main([CONFIG, "--world-size", "4", f"--model.hf_assets_path={hf}", f"--data.path={path}"])
    assert code == 2 and f"{path} row 1: missing key 'answer'" in capsys.readouterr().err
    assert main([CONFIG, "--world-size", "4", f"--model.hf_assets_path={hf}", f"--data.path={path}",
                 "--data.skip_bad_rows=true"]) == 0
    assert "skipped_rows=1" in capsys.readouterr().out


def test_hf_model_needs_a_prompt_file(hf):
    with pytest.raises(ConfigError, match=r"\[data\] path: an HF model"):
        _validate(hf, "--data.path=")


def test_final_hf_export_is_not_taken_for_a_resumable_checkpoint(tmp_path):
    from titan_foremoe.config.preflight import latest_hf_export_step as latest_hf_only_step

    assert latest_hf_only_step(str(tmp_path / "none")) is None
    (tmp_path / "step-10").mkdir()
    (tmp_path / "step-10" / ".metadata").write_text("")
    assert latest_hf_only_step(str(tmp_path)) is None  # DCP: torchtitan resumes from it
    (tmp_path / "step-20").mkdir()
    (tmp_path / "step-20" / "model.safetensors.index.json").write_text("{}")
    assert latest_hf_only_step(str(tmp_path)) == 20  # an HF export: a finished job, not a resume point
    (tmp_path / "step-30").mkdir()  # an interrupted DCP save (no .metadata, no index): skipped, not an export
    assert latest_hf_only_step(str(tmp_path)) is None
