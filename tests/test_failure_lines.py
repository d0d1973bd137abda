"""Failures named in one line (issue 40): the stalled rank from the heartbeats, the failing worker's line as the
launcher's last, a rendezvous port held by another program, row errors of the tokenizer."""

from __future__ import annotations


def test_heartbeats_name_the_late_ranks():
    """Rank 0 waits in a collective; rank 1 runs its reward, rank 2 waits too, rank 3 stopped beating (SIGSTOP)."""
    import json
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

    from titan_foremoe.distributed.launch import failure_line
    from titan_foremoe.train.failures import record_line

    line = "error: step 2: [rl] reward_fn 'x:y' returned nan (not finite) for prompt 3"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "0.json"))
    record_line(line)
    stopped = ProcessFailure(local_rank=1, pid=12, exitcode=-signal.SIGTERM, error_file=str(tmp_path / "none"))
    first = ProcessFailure(local_rank=0, pid=11, exitcode=2, error_file=str(tmp_path / "0.json"))
    assert failure_line(ChildFailedError("t", {1: stopped, 0: first}), "L") == (line, 2)
    raised = tmp_path / "r.json"
    raised.write_text(json.dumps({"message": {"message": "RuntimeError: rank 0 failed in phase 'step 1': boom\nmore",
                                              "extraInfo": {"timestamp": "1", "py_callstack": "..."}}}))
    got = failure_line(ChildFailedError("t", {0: ProcessFailure(0, 11, 1, str(raised)), 1: stopped}), "L")
    assert got == ("error: rank 0 failed in phase 'step 1': boom (torchrun's report: L)", 1)
    killed = ProcessFailure(local_rank=1, pid=13, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "none"))
    assert failure_line(ChildFailedError("t", {1: killed}), "L") == (
        "error: rank 1 (pid 13) was killed by SIGKILL (out of memory? see the kernel log: dmesg); torchrun's "
        "report: L", 1)
