"""Issue 46: a crash is never reported as a preemption.

* the launcher names the first worker to fail in time, not a bystander torchrun stopped after it (exit 143 with
  "resume with" is a stop from outside only): a worker SIGKILLed while torchrun tears the others down, end to end;
* the watchdog tells a dead peer from a stuck one, and names the trainer's phase, never the heartbeat's frame;
* a worker waiting for its peers at start-up says so at once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

ROOT = Path(__file__).resolve().parents[1]


class _Clock:
    """An ``ExitClock`` stand-in: exit times by pid."""

    def __init__(self, times: dict[int, float]):
        self.times = times

    def exited_at(self, pid):
        return self.times.get(pid)


def test_the_first_failure_in_time_is_the_root_not_the_bystander(tmp_path, monkeypatch):
    """A SIGKILLed rank 1 and rank 0 stopped by torchrun's SIGTERM in the same second (its exit read first, its
    rank lower): rank 1 is named, exit 1, never a stop; a peer's 'connection closed' error noted before the
    killed worker's exit was read does not win either; a stop that came first stays a stop."""
    from titan_foremoe.distributed.launch import failure_line, root_failure
    from titan_foremoe.distributed.stop_signals import stop_signal
    from titan_foremoe.train.failures import failure_time, note_failure_time

    none = str(tmp_path / "none")
    killed = ProcessFailure(local_rank=1, pid=12, exitcode=-signal.SIGKILL, error_file=none)
    stopped = ProcessFailure(local_rank=0, pid=11, exitcode=128 + signal.SIGTERM, error_file=none)
    stopped.timestamp = killed.timestamp
    both = ChildFailedError("t", {0: stopped, 1: killed})
    assert root_failure(both)[0] == 1  # whole seconds only: a signal's death beats torchrun's SIGTERM
    t = time.time()
    assert root_failure(both, _Clock({11: t + 0.02, 12: t}))[0] == 1
    line, code = failure_line(both, "L", _Clock({11: t + 0.02, 12: t}), kept={1: "D/worker_logs/rank-1.stderr"})
    assert code == 1 and line == ("error: rank 1 (pid 12) was killed by SIGKILL (out of memory? see the kernel log: "
                                  "dmesg); its stderr: D/worker_logs/rank-1.stderr; torchrun's report: L")
    # rank 0 failed in its collective because rank 1 died; its note came 5 ms before rank 1's exit was read
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "0.json"))
    note_failure_time()
    (tmp_path / "0.json").write_text(json.dumps({"message": {
        "message": "RuntimeError: rank 0 failed in phase 'step 2 rollout', in collective all_reduce: "
                   "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:1234",
        "extraInfo": {"timestamp": "1", "py_callstack": "..."}}}))
    noted = failure_time(str(tmp_path / "0.json"))
    assert noted is not None and abs(noted - time.time()) < 5
    peer = ProcessFailure(local_rank=0, pid=11, exitcode=1, error_file=str(tmp_path / "0.json"))
    assert root_failure(ChildFailedError("t", {0: peer, 1: killed}), _Clock({12: noted + 0.005}))[0] == 1
    # a Python error first, the other rank stopped by torchrun: the error is named, with the file of its traceback
    raised = ProcessFailure(local_rank=0, pid=11, exitcode=1, error_file=str(tmp_path / "0.json"))
    later = ProcessFailure(local_rank=1, pid=12, exitcode=128 + signal.SIGTERM, error_file=none)
    got = failure_line(ChildFailedError("t", {0: raised, 1: later}), "L", _Clock({12: noted + 1.5}),
                       kept={0: "D/worker_logs/rank-0.stderr"})
    assert got[1] == 1 and got[0].startswith("error: rank 0 failed in phase 'step 2 rollout'")
    assert got[0].endswith("(its stderr: D/worker_logs/rank-0.stderr; torchrun's report: L)")
    # a scheduler's SIGTERM reached rank 0 first; rank 1 then failed in its collective: a stop
    first = ProcessFailure(local_rank=0, pid=11, exitcode=128 + signal.SIGTERM, error_file=none)
    second = ProcessFailure(local_rank=1, pid=12, exitcode=1, error_file=str(tmp_path / "0.json"))
    root = root_failure(ChildFailedError("t", {0: first, 1: second}), _Clock({11: t, 12: t + 0.5}))
    assert root[0] == 0 and stop_signal(root[1].exitcode) == signal.SIGTERM


def test_exit_clock_times_each_worker_and_the_teardown(tmp_path):
    """``ExitClock.watch`` notes a worker's exit time while torchrun's ``poll`` still reads its exit code."""
    from titan_foremoe.distributed.worker_exits import ExitClock, keep_stderr

    err = tmp_path / "err.log"
    err.write_text("x" * 70_000 + "\nTraceback: boom\n")
    clock = ExitClock()
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    before = time.time()
    clock.watch(proc, rank=3, stderr=str(err))
    deadline = time.monotonic() + 30
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert proc.poll() == -signal.SIGKILL
    for _ in range(100):
        if clock.exited_at(proc.pid) is not None:
            break
        time.sleep(0.01)
    assert before - 1 <= clock.exited_at(proc.pid) <= time.time()
    kept = keep_stderr(clock, str(tmp_path / "worker_logs"))
    assert kept == {3: str(tmp_path / "worker_logs" / "rank-3.stderr")}
    text = Path(kept[3]).read_text()
    assert text.endswith("Traceback: boom\n") and len(text) <= 64 * 1024


def test_a_sigkilled_worker_is_named_while_torchrun_stops_the_other(tmp_path):
    """End to end, 2 gloo ranks: rank 1 is SIGKILLed in step 2's rollout while rank 0 is busy in Python, so that
    torchrun's SIGTERM stops rank 0 (exit 143, its exit read in the same second, lower rank): it was reported as
    ``launch: stopped by SIGTERM (to a worker)``, exit 143, "resume with". Now the killed rank, its signal and its
    phase, exit 1, and every rank's stderr kept."""
    dump = tmp_path / "job"
    args = ["--parallelism.expert_parallel_degree=2", "--model.n_layers=2", "--training.local_batch_size=4",
            "--training.global_batch_size=16", "--rl.samples_per_prompt=4", "--rl.sft_warmup_steps=1",
            "--training.steps=2", "--comm.train_timeout_seconds=4", "--rl.reward_fn=tests.faults:crash",
            "--balance.balancer=off", "--metrics.enable_tensorboard=false", f"--job.dump_folder={dump}"]
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "2", "FAULT_RANK": "1", "FAULT_CALL": "1",
           "FAULT_DELAY": "3", "FAULT_SLEEP": "60"}
    proc = subprocess.run([str(ROOT / "run_train.sh"), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "resume with" not in proc.stderr and "stopped by" not in proc.stderr
    assert re.fullmatch(r"error: rank 1 \(pid \d+\) was killed by SIGKILL in phase 'step 2 rollout' \(its last "
                        r"heartbeat, [\d.]+ s before\) \(out of memory\? see the kernel log: dmesg\); its stderr: "
                        rf"{dump}/worker_logs/rank-1\.stderr; torchrun's report: {dump}/launch\.log", last), last
    assert sorted(p.name for p in (dump / "worker_logs").iterdir()) == ["rank-0.stderr", "rank-1.stderr"]


def test_a_dead_peer_is_told_from_a_stuck_one_and_the_phase_is_the_trainers():
    """Rank 1's process is gone (this host), rank 2's heartbeats stopped 2.3 periods ago (another host), rank 3 is
    alive in its reward: only rank 3 is 'stuck'."""
    import socket

    from titan_foremoe.train.watchdog import late_lines

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    now = time.time()
    here = socket.gethostname()
    beats = {1: {"phase": "start-up", "in_phase_s": 1.0, "wall": now - 0.5, "collective": None,
                 "at": "trainer.py:9 build", "host": here, "pid": gone.pid},
             2: {"phase": "step 2 rollout", "in_phase_s": 1.0, "wall": now - 2.3, "collective": None,
                 "at": "decode.py:3 step", "host": "elsewhere", "pid": 1},
             3: {"phase": "step 2 rollout", "in_phase_s": 9.0, "wall": now - 0.2, "collective": None,
                 "at": "myrw.py:3 sleeps", "host": here, "pid": os.getpid()}}
    assert late_lines(beats, now, 1.0, me=0) == [
        f"rank 1 died (its process {gone.pid} on this host is gone; last heartbeat 0 s ago, in 'start-up')",
        "rank 2 silent for 2 s (frozen, stopped or dead; last seen in 'step 2 rollout' for 1 s)",
        "rank 3 stuck in 'step 2 rollout' (at myrw.py:3 sleeps) for 9 s"]
    # the first heartbeat, posted from the main thread: test_failure_lines.py::test_heartbeats_name_the_late_ranks


def test_a_worker_waiting_for_its_peers_says_so_at_once(tmp_path):
    """A worker started by hand with a leftover WORLD_SIZE=2 (and RANK, MASTER_*): the wait is named at once (it
    was silent for [comm] init_timeout_seconds, 300 s), and again every 30 s (here 0.2 s)."""
    from titan_foremoe.distributed.start_wait import announce_wait

    lines: list[str] = []
    env = {"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29712"}
    with announce_wait(300, every_s=0.2, env=env, log=lines.append):
        time.sleep(0.5)
    assert lines[0].startswith("rank 0: waiting for 2 ranks at 127.0.0.1:29712 ([comm] init_timeout_seconds = 300)")
    assert "WORLD_SIZE=2 left in the environment" in lines[0]
    assert any(x.startswith("rank 0: still waiting for 2 ranks at 127.0.0.1:29712 after 0 s") for x in lines[1:])
    under_torchrun: list[str] = []
    with announce_wait(300, every_s=30, env={**env, "TORCHELASTIC_RUN_ID": "x"}, log=under_torchrun.append):
        pass
    assert under_torchrun == []  # the rendezvous gathered the ranks: nothing to say within 30 s
    from distributed_helpers import free_port

    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "titan_foremoe.train", "--job.config_file",
         str(ROOT / "train_configs" / "debug_tiny_cpu.toml"), f"--job.dump_folder={tmp_path / 'job'}",
         "--comm.init_timeout_seconds=60"],
        cwd=ROOT, env={**os.environ, **env, "MASTER_PORT": str(port)}, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        seen = []
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            seen.append(line)
            if line.startswith(f"rank 0: waiting for 2 ranks at 127.0.0.1:{port}") or not line:
                break
        assert seen[-1].startswith(f"rank 0: waiting for 2 ranks at 127.0.0.1:{port}"), "".join(seen)[-2000:]
    finally:
        proc.kill()
        proc.wait()


CPU_CFG = str(ROOT / "train_configs" / "debug_tiny_cpu.toml")
RL_CFG = str(ROOT / "train_configs" / "debug_tiny_rl.toml")


def test_seq_len_needed_is_named_once_with_the_larger_need(tmp_path):
    """sort_digits with RL: one check said 19 was needed, the next refused 19 for 20."""
    from titan_foremoe.config import ConfigError, load_config
    from titan_foremoe.config.validate import validate

    def check(config, n):
        return validate(load_config(config, [f"--job.dump_folder={tmp_path}", f"--training.seq_len={n}"]), 4)

    with pytest.raises(ConfigError, match=r"^\[training\] seq_len: 18 is too short for sort_digits: it needs 20 input "
                                          r"tokens \(the longest example: 19; the longest prompt \+ \[rl\] "
                                          r"max_new_tokens - 1: 20\): set seq_len = 20 or more$"):
        check(RL_CFG, 18)
    with pytest.raises(ConfigError, match=r"needs 20 input tokens"):
        check(RL_CFG, 19)
    check(RL_CFG, 20)
    with pytest.raises(ConfigError, match=r"18 is too short for sort_digits: it needs 19 input tokens"):
        check(CPU_CFG, 18)
    check(CPU_CFG, 19)


def test_max_staleness_above_its_bound_is_refused(tmp_path):
    """k steps in flight (``sources/in_flight.py``) up to ``MAX_STALENESS``; above it, one line naming the bound."""
    from titan_foremoe.config import ConfigError, load_config
    from titan_foremoe.config.validate import MAX_STALENESS, validate

    k = MAX_STALENESS + 1
    cfg = load_config(RL_CFG, [f"--job.dump_folder={tmp_path}", f"--rl.max_staleness={k}"])
    with pytest.raises(ConfigError, match=rf"^\[rl\] max_staleness: at most {MAX_STALENESS} steps of rollouts in "
                                          rf"flight .*, got {k}$"):
        validate(cfg, 4)


def test_a_token_budget_is_stated_not_the_row_count(tmp_path, capsys):
    from titan_foremoe.config.check import main

    assert main([RL_CFG, "--world-size", "4", f"--job.dump_folder={tmp_path}",
                 "--training.max_tokens_per_micro_step=64"]) == 0
    out = capsys.readouterr().out
    assert " micro_steps=by a 64-token budget per rank " in out and "micro_steps=2" not in out, out


def test_a_finished_job_on_a_folder_it_cannot_write_says_it_finished(tmp_path):
    """The outputs of a finished job made read-only (here: its TensorBoard folder blocked by a file): the rerun
    said 'not a writable folder' (exit 2) instead of 'job already finished' (exit 0)."""
    from titan_foremoe.config import load_config
    from titan_foremoe.config.preflight import JobFinished, preflight

    dump = tmp_path / "job"
    (dump / "checkpoint" / "step-2").mkdir(parents=True)
    (dump / "checkpoint" / "step-2" / ".metadata").write_bytes(b"")
    (dump / "tb").write_text("not a folder")
    cfg = load_config(CPU_CFG, [f"--job.dump_folder={dump}", "--training.steps=2", "--checkpoint.enable=true"])
    with pytest.raises(JobFinished, match="job already finished"):
        preflight(cfg)


def test_the_launch_log_moves_when_the_dump_folder_cannot_take_it(tmp_path):
    """After a disk-full failure the line pointed at an empty DUMP/launch.log: the log goes where it can be
    written, and the line names that file."""
    from titan_foremoe.distributed.stop_signals import ShutdownLog

    (tmp_path / "full").write_text("a file where the dump folder should be")
    log = ShutdownLog(str(tmp_path / "full" / "launch.log"))
    log.write("torchrun's report\n")
    assert log.path != str(tmp_path / "full" / "launch.log")
    assert Path(log.path).read_text() == "torchrun's report\n"
    os.remove(log.path)


def test_the_dump_naming_is_documented():
    """Rollout dumps and loads are named by the step counted from 0 over the whole job: the docs say so."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    assert "``step_00001.jsonl`` holds the rollouts of the log's ``step 2``" in text
