"""Failures named in one line (issue 40): the stalled rank from the heartbeats, the failing worker's line as the
launcher's last, a rendezvous port held by another program, row errors of the tokenizer."""

from __future__ import annotations

import pytest


def test_heartbeats_name_the_late_ranks():
    """Rank 0 waits in a collective; rank 1 runs its reward, rank 2 waits too, rank 3 stopped beating (SIGSTOP)."""
    import json
    import os
    import socket
    import time

    from torch.distributed import HashStore

    from titan_foremoe.train.watchdog import Watchdog, late_lines

    now = time.time()
    beats = {0: {"phase": "step 2 rollout", "in_phase_s": 9.0, "wall": now, "collective": "all_reduce", "at": None},
             1: {"phase": "step 2 rollout", "in_phase_s": 59.0, "wall": now - 1, "collective": None,
                 "at": "myrw.py:3 sleeps"},
             2: {"phase": "step 2 rollout", "in_phase_s": 9.0, "wall": now, "collective": "all_reduce", "at": None},
             3: {"phase": "step 2 update micro-step 1", "in_phase_s": 2.0, "wall": now - 40, "collective": None,
                 "at": "moe.py:1 forward"}}
    assert late_lines(beats, now, 5.0, me=0) == [
        "rank 1 stuck in 'step 2 rollout' (at myrw.py:3 sleeps) for 60 s",
        "rank 3 silent for 40 s (frozen, stopped or dead; last seen in 'step 2 update micro-step 1' for 2 s)"]
    store = HashStore()
    dog = Watchdog(0, timeout_s=120)
    try:
        dog.attach(store, 4)
        dog.phase("step 2 rollout")
        posted = json.loads(store.get("titan_foremoe/heartbeat/0"))
        assert posted["phase"] == "start-up" and posted["at"]  # the main thread, here: not in a collective
        # the trainer's line, never the watchdog's own beat (issue 46: 'at watchdog.py:131 beat'); host and pid
        assert posted["at"].startswith("test_failure_lines.py:") and "watchdog.py" not in posted["at"], posted
        assert posted["pid"] == os.getpid() and posted["host"] == socket.gethostname()
        for rank in (1, 2, 3):
            store.set(f"titan_foremoe/heartbeat/{rank}", json.dumps(beats[rank]))
        assert [line.split(" (")[0] for line in dog.late_ranks()] == ["rank 1 stuck in 'step 2 rollout'",
                                                                       "rank 3 silent for 40 s"]
    finally:
        dog.close()


def test_the_first_failed_workers_line_is_the_launchers_last(tmp_path, monkeypatch):
    """Exit 2 with its line in the error file, an exception (``@record``), a SIGKILL without a file."""
    import json
    import signal

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from titan_foremoe.distributed.launch import failure_line, root_failure
    from titan_foremoe.distributed.launch import stopped as by_stop_signal
    from titan_foremoe.train.failures import record_line

    line = "error: step 2: [rl] reward_fn 'x:y' returned nan (not finite) for prompt 3"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "0.json"))
    record_line(line)
    stopped = ProcessFailure(local_rank=1, pid=12, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none"))
    first = ProcessFailure(local_rank=0, pid=11, exitcode=2, error_file=str(tmp_path / "0.json"))
    assert failure_line(ChildFailedError("t", {1: stopped, 0: first}), "L") == (line, 2)
    # every rank found the same bad input: rank 1 exited 2 first, and torchrun's SIGTERM stopped rank 0 after it
    # wrote its line (exit 143, same second): the bad input is the cause, not a stop signal
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "1.json"))
    record_line(line)
    wrote_then_stopped = ProcessFailure(local_rank=0, pid=11, exitcode=128 + signal.SIGTERM,
                                        error_file=str(tmp_path / "0.json"))
    exited_2 = ProcessFailure(local_rank=1, pid=12, exitcode=2, error_file=str(tmp_path / "1.json"))
    wrote_then_stopped.timestamp = exited_2.timestamp
    both = ChildFailedError("t", {0: wrote_then_stopped, 1: exited_2})
    assert not by_stop_signal(root_failure(both)[1])  # both noted the same failure: whichever first, not a stop
    assert failure_line(both, "L") == (line, 2)
    raised = tmp_path / "r.json"
    raised.write_text(json.dumps({"message": {"message": "RuntimeError: rank 0 failed in phase 'step 1': boom\nmore",
                                              "extraInfo": {"timestamp": "1", "py_callstack": "..."}}}))
    got = failure_line(ChildFailedError("t", {0: ProcessFailure(0, 11, 1, str(raised)), 1: stopped}), "L")
    assert got == ("error: rank 0 failed in phase 'step 1': boom (torchrun's report: L)", 1)
    killed = ProcessFailure(local_rank=1, pid=13, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none"))
    assert failure_line(ChildFailedError("t", {1: killed}), "L") == (
        "error: rank 1 (pid 13) was killed by SIGKILL (out of memory? see the kernel log: dmesg); torchrun's "
        "report: L", 1)


def _silent_listener():
    """A program holding a port: it accepts connections and never answers (what hung torchrun)."""
    import socket
    import threading

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held = []

    def serve():
        while True:
            try:
                held.append(server.accept()[0])
            except OSError:
                return

    threading.Thread(target=serve, daemon=True).start()
    return server, server.getsockname()[1]


def test_rendezvous_port_held_by_another_program_is_refused(monkeypatch):
    import socket
    import time
    from datetime import timedelta

    from torch.distributed import TCPStore

    from titan_foremoe.distributed.launch import endpoint_problem

    server, port = _silent_listener()
    try:
        t = time.monotonic()
        why = endpoint_problem(f"localhost:{port}", "", 300)
        assert why.startswith(f"port {port} on this host is held by a program that does not answer as a "
                              "rendezvous store") and "RDZV_ENDPOINT=localhost:0" in why, why
        assert time.monotonic() - t < 15
        from torch.distributed.elastic.rendezvous import utils

        monkeypatch.setattr(utils, "_matches_machine_hostname", lambda host: False)  # as seen from another node
        why = endpoint_problem(f"127.0.0.1:{port}", "", 2)  # bounded by join_timeout_seconds
        assert why.startswith(f"127.0.0.1:{port} does not answer as a rendezvous store within 2 s"), why
        monkeypatch.undo()
    finally:
        server.close()
    assert endpoint_problem("localhost:0", "", 300) is None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert endpoint_problem(f"localhost:{free}", "", 300) is None
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    assert endpoint_problem(f"localhost:{store.port}", "", 300) is None  # another local agent's store: joined


def test_launcher_refuses_a_held_port_in_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    server, port = _silent_listener()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "titan_foremoe.distributed.launch", "--nnodes=1", "--nproc_per_node=1",
             "--rdzv_backend", "c10d", f"--rdzv_endpoint=localhost:{port}", "-m", "titan_foremoe.train",
             "--job.config_file", str(root / "train_configs" / "debug_tiny_rl.toml"),
             f"--job.dump_folder={tmp_path}"],
            cwd=root, capture_output=True, text=True, timeout=120)
    finally:
        server.close()
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"launch error: rendezvous localhost:{port} (--rdzv-id none): port {port} on this host "
                           "is held by a program"), line


def test_a_lone_surrogate_is_a_row_error_that_skip_bad_rows_skips(tmp_path):
    """A JSON ``\\ud83d`` escape (half an emoji) reached the Rust tokenizer as a 34-line ``TypeError`` naming no row."""
    import pytest

    from titan_foremoe.data.hf_tokenizer import HFTokenizer
    from titan_foremoe.data.prompts import DatasetError, PromptDataset
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    tok = HFTokenizer(make_tiny_checkpoint(str(tmp_path / "tiny"), read_texts("examples/arithmetic_word_problems.jsonl"),
                                           n_layers=1))
    with pytest.raises(TypeError):
        tok.encode("Tom has \ud83d 3 pens.")  # the oracle: the tokenizer itself refuses it
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "Tom has 3 pens.", "answer": "3"}\n{"prompt": "Tom has \\ud83d 3 pens.", "answer": "3"}\n'
                    '{"prompt": "Ann has 2.", "answer": "2\\udc00"}\n')
    with pytest.raises(DatasetError, match=rf"{path} row 1: the prompt holds a lone UTF-16 surrogate U\+D83D at "
                                           r"character \d+"):
        PromptDataset(str(path), tok, max_prompt_tokens=60)
    ds = PromptDataset(str(path), tok, max_prompt_tokens=60, skip_bad_rows=True)
    assert (len(ds), ds.skipped) == (1, 2)


@pytest.mark.parametrize("command", [
    ["scripts/dry_run.py", "--config", "train_configs/debug_tiny_rl.toml", "--world-size", "2", "--rl.nope=1"],
    ["-m", "titan_foremoe.rollouts", "import", "x.jsonl", "--format", "vllm", "--out", "y", "--model-config",
     "train_configs/debug_tiny_rl.toml", "--rl.nope=1"],
])
def test_user_scripts_print_config_errors_in_one_line(command):
    import subprocess
    import sys
    from pathlib import Path

    proc = subprocess.run([sys.executable, *command], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("config error: ") and "nope" in line, line


@pytest.mark.parametrize("gpus", ["0", "-1"])
def test_selftest_refuses_no_devices(gpus):
    from titan_foremoe.selftest import main

    assert main(["--gpus", gpus]) == 2


def test_a_boxed_reward_names_the_fix_not_bad_reward_zero():
    """A 0-dim tensor reward was refused with the hint ``bad_reward = 'zero'``, which scores every reward 0."""
    import numpy as np
    import torch

    from titan_foremoe.rl.reward_check import reward_problem, stop_hint

    for boxed, kind in ((torch.tensor(1.0), "a 0-dim torch.Tensor"), (np.array(0.5), "a 0-dim numpy.ndarray"),
                        ([1.0], "a one-element list")):
        problem = reward_problem(boxed)
        assert problem.startswith(f"{kind}, not a number: the reward function must return float(reward)"), problem
        assert stop_hint(problem).startswith("fix the reward function")
    assert reward_problem(np.float32(0.5)) is None and reward_problem(1) is None
    assert "bad_reward = 'zero' scores such rewards 0" in stop_hint(reward_problem(float("nan")))


@pytest.mark.parametrize("override", ["--training.steps=9223372036854775807", "--rl.sft_warmup_steps=1000000001"])
def test_steps_have_an_upper_bound(override):
    from pathlib import Path

    from titan_foremoe.config import ConfigError, load_config
    from titan_foremoe.config.validate import validate

    cfg = load_config(Path(__file__).resolve().parents[1] / "train_configs" / "debug_tiny_rl.toml", [override])
    with pytest.raises(ConfigError, match=r"must be <= 1,000,000,000 \(a job's steps"):
        validate(cfg, 4)


@pytest.mark.parametrize("text", ['[\n  {"prompt": "a", "answer": "1"},\n  {"prompt": "b", "answer": "2"}\n]\n',
                                  '\n[{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]\n'])
def test_a_json_array_saved_as_jsonl_is_named(tmp_path, text):
    """It said "Expecting value: line 1 column 2" (pretty-printed) or "expected an object per line"."""
    from titan_foremoe.data.records import RecordError, iter_records

    path = tmp_path / "d.jsonl"
    path.write_text(text)
    with pytest.raises(RecordError, match=rf"^{path}: one JSON array, not JSON lines \(one object per line\): "
                                          rf"convert it with jq -c '\.\[\]' {path} > "):
        list(iter_records(path))


def test_a_token_id_the_engine_did_not_sample_is_named():
    """A token id edited (or outside the vocabulary) was reported as a missing log-prob."""
    import numpy as np

    from titan_foremoe.rollouts import RolloutError, RolloutSample
    from titan_foremoe.rollouts.formats.vllm import read_vllm, write_vllm

    s = RolloutSample(np.array([1, 2, 3, 4], dtype=np.int64), 2, np.zeros((3, 1, 1), dtype=np.int64),
                      np.array([np.nan, np.nan, -0.5, -0.25], dtype=np.float32))
    rec = write_vllm([s])
    rec["outputs"][0]["token_ids"][1] = 151_936  # outside a 151,936-token vocabulary
    with pytest.raises(RolloutError, match=r"completion position 1: token id 151936, the engine's log-probs name "
                                           r"ids \[4\] \(token ids changed after generation, or not of this "
                                           r"model's vocabulary\?\)"):
        read_vllm(rec, "x", (1, 1))


def test_routes_npy_edited_after_import_names_the_file(tmp_path):
    import json

    import numpy as np

    from titan_foremoe.rollouts import ModelSpec, RolloutSample, RolloutStore, import_rollouts
    from titan_foremoe.rollouts.formats.vllm import write_vllm

    s = RolloutSample(np.array([1, 2, 3, 4], dtype=np.int64), 2, np.array([[[1, 2]], [[3, 4]], [[5, 6]]]),
                      np.array([np.nan, np.nan, -0.5, -0.25], dtype=np.float32), reward=1.0)
    (tmp_path / "in.jsonl").write_text(json.dumps(write_vllm([s])) + "\n")
    import_rollouts("vllm", [tmp_path / "in.jsonl"], tmp_path / "out", ModelSpec(1, 2, 8, 64))
    (routes,) = (tmp_path / "out").glob("*/routes.npy")
    assert RolloutStore(tmp_path / "out").read(0).routes_RXK.tolist() == [[[1, 2]], [[3, 4]], [[5, 6]]]
    edited = np.load(routes)
    edited[1, 0, 0] = 200
    np.save(routes, edited)
    with pytest.raises(ValueError, match=rf"{routes} holds expert id 200 \(min 1\), outside \[0, 8\): edited after "
                                         "import\\? import again"):
        RolloutStore(tmp_path / "out").read(0)
    np.save(routes, edited[:, :, :1])
    with pytest.raises(ValueError, match=rf"{routes}: shape \[3, 1, 1\] dtype uint8, the import wrote "
                                         r"\[positions, 1, 2\] integers"):
        RolloutStore(tmp_path / "out").read(0)


def test_all_zero_advantages_are_named_in_one_line():
    """A step whose groups all have equal rewards (a constant reward function) is warned about, not trained on in
    silence: the line names the step, the reward and what to do."""
    from titan_foremoe.train.rl_trainer import zero_advantages_line

    line = zero_advantages_line(4, "mypkg.rw:constant", 128)
    assert line.startswith("step 5: all 128 advantages are 0") and "'mypkg.rw:constant'" in line
    assert "filter_groups" in line and "\n" not in line
