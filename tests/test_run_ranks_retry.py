"""``run_ranks(crash_retries=1)`` (tests/distributed_helpers.py): a rank killed by a signal is run again once,
a rank that raises is never retried; ``killed_by_signal`` reads torchrun's report the same way."""

from __future__ import annotations

import os
import signal

import pytest
import torch.multiprocessing as mp

import subprocess

from distributed_helpers import killed_by_signal, rerun_if_killed, run_ranks


def _abort_first_time(rank, world_size, marker):
    if rank == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        os.kill(os.getpid(), signal.SIGABRT)


def _raise(rank, world_size, marker):
    open(marker + str(rank), "a").write("x")
    raise ValueError("wrong")


def test_a_rank_killed_by_a_signal_runs_again_once(tmp_path):
    marker = str(tmp_path / "aborted")
    run_ranks(_abort_first_time, 2, marker, crash_retries=1)
    assert os.path.exists(marker)
    with pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        run_ranks(_abort_first_time, 2, str(tmp_path / "again"), crash_retries=0)


def test_a_rank_that_raises_is_not_retried(tmp_path):
    with pytest.raises(Exception, match="wrong"):
        run_ranks(_raise, 2, str(tmp_path / "m"), crash_retries=1)
    written = [open(f).read() for f in (str(tmp_path / "m") + str(r) for r in range(2)) if os.path.exists(f)]
    assert written and all(w == "x" for w in written), written  # one attempt (the other rank may be stopped first)


def test_killed_by_signal_reads_torchruns_report(tmp_path):
    """A rank's negative exit code other than -15 (torchrun stopping the rest) counts, on the screen or in the log."""
    line = "failed (exitcode: {}) local_rank: 2 (pid: 25098) of binary: python"
    assert killed_by_signal(line.format(-6)) and killed_by_signal(line.format(-11))
    assert not killed_by_signal(line.format(-15)) and not killed_by_signal(line.format(1))
    log = tmp_path / "launch.log"
    assert not killed_by_signal("", log)  # no log: nothing read
    log.write_text(line.format(-6))
    assert killed_by_signal("", log)


def test_a_job_killed_by_a_signal_runs_again_once_in_an_emptied_folder(tmp_path):
    """``rerun_if_killed``: a crash line reruns once, its folder removed first; any other failure, and a second
    crash, is returned as it is."""
    crash = "failed (exitcode: -6) local_rank: 2 (pid: 1) of binary: python"
    folder = tmp_path / "out"

    def job(outcomes, found):
        def run():
            found.append(folder.exists())  # what the run finds: the last run's folder, or none
            folder.mkdir(exist_ok=True)
            code, text = outcomes.pop(0)
            return subprocess.CompletedProcess([], code, text, "")
        return run

    outcomes, found = [(1, crash), (0, "fine")], []
    assert rerun_if_killed(job(outcomes, found), folder, "t").returncode == 0 and not outcomes
    assert found == [False, False]  # the crashed run's folder was removed before the rerun
    outcomes, found = [(1, "loss differs"), (0, "fine")], []
    assert rerun_if_killed(job(outcomes, found), folder, "t").returncode == 1 and len(outcomes) == 1  # not rerun
    outcomes = [(1, crash), (1, crash), (0, "fine")]
    assert rerun_if_killed(job(outcomes, []), folder, "t").returncode == 1 and len(outcomes) == 1  # once only
