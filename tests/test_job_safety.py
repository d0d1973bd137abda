"""Issue 31, the job's life on a cluster: workers die with their launcher (SIGKILLed, as a scheduler may); one
job per dump folder (a second one is refused in one line naming the holder, before any worker starts); SIGTERM or
Ctrl-C end in one line naming the signal, the last complete checkpoint and the resume command."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from titan_foremoe.distributed import folder_lock

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "train_configs" / "debug_tiny_cpu.toml"


def launch(dump: Path, log: Path, *overrides: str, ngpu: int = 2, env: dict | None = None) -> subprocess.Popen:
    """``run_train.sh`` on ``ngpu`` gloo ranks of the CPU debug job, output to ``log``, in a session of its own
    (as a terminal's foreground job: ``os.killpg`` is Ctrl-C)."""
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": str(ngpu), "CONFIG_FILE": str(CPU), **(env or {})}
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(ROOT / "run_train.sh"), f"--job.dump_folder={dump}", f"--parallelism.expert_parallel_degree={ngpu}",
             "--training.global_batch_size=16", "--metrics.enable_tensorboard=false", *overrides],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True,
            # as from a terminal: a runner started in the background (SIGINT ignored, inherited) would make the
            # job deaf to Ctrl-C, and bash cannot trap a signal ignored on entry
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def children(pid: int, marker: str) -> list[int]:
    """Live processes whose parent is ``pid`` and whose command line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z" and marker in cmd:
            found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def wait_for(predicate, timeout_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def running(dump: Path, log: Path, *overrides: str, at_step: int = 3):
    """The 2-rank debug job, yielded as ``(launcher, worker pids)`` once it has logged step ``at_step``; whatever
    the test does, nothing it started is left running afterwards."""
    launcher = launch(dump, log, "--training.steps=100000", "--metrics.log_freq=1", *overrides)
    workers: list[int] = []
    try:
        workers = wait_for(lambda: (w := children(launcher.pid, "titan_foremoe.train")) and len(w) == 2 and w,
                           120, "two workers")
        wait_for(lambda: f"step {at_step:3d}" in log.read_text() or launcher.poll() is not None, 180,
                 f"step {at_step}")
        assert launcher.poll() is None, log.read_text()[-3000:]
        yield launcher, workers
    finally:
        for w in workers:
            if alive(w):
                os.kill(w, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def test_workers_die_with_a_sigkilled_launcher(tmp_path):
    with running(tmp_path / "job", tmp_path / "out.log", at_step=2) as (launcher, workers):
        # a second job on the folder: its pre-flight names the running launcher, in one line
        second = subprocess.run([sys.executable, "-m", "titan_foremoe.config.check", str(CPU), "--world-size", "2",
                                 "--preflight", f"--job.dump_folder={tmp_path / 'job'}",
                                 "--parallelism.expert_parallel_degree=2"],
                                cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
        assert (f"config error: [job] dump_folder: {tmp_path / 'job'} is in use by another job (pid {launcher.pid} "
                f"on host {socket.gethostname()}") in second.stderr
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        start = time.monotonic()
        left = workers
        while left and time.monotonic() - start < 10:
            time.sleep(0.2)
            left = [w for w in left if alive(w)]
        assert not left, f"workers {left} still alive 10 s after the launcher was killed"


def test_a_child_started_with_the_preexec_ends_with_its_parent(tmp_path):
    """What the trainer's vLLM server gets: a middle process killed with SIGKILL takes its child with it."""
    pid_file = tmp_path / "child.pid"
    code = ("import subprocess, sys, time\n"
            "from titan_foremoe.distributed.parent_death import dying_with_this_process\n"
            "p = subprocess.Popen(['sleep', '60'], preexec_fn=dying_with_this_process(), start_new_session=True)\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "time.sleep(60)\n")
    middle = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    child = 0
    try:
        child = wait_for(lambda: pid_file.exists() and pid_file.read_text() and int(pid_file.read_text()), 30,
                         "the child")
        assert alive(child)
        middle.kill()
        middle.wait(5)
        wait_for(lambda: not alive(child), 5, "the child to end")
    finally:
        if child and alive(child):
            os.kill(child, signal.SIGKILL)
        if middle.poll() is None:
            middle.kill()


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_dump_folder_lock_names_its_holder_and_takes_over_stale_ones(tmp_path):
    folder = str(tmp_path / "job")
    lock = folder_lock.acquire(folder)
    path = Path(folder) / folder_lock.LOCK_NAME
    holder = json.loads(path.read_text())
    assert (holder["pid"], holder["host"], lock.took_over) == (os.getpid(), socket.gethostname(), None)
    with pytest.raises(folder_lock.FolderBusy) as e:
        folder_lock.check_free(folder)
    assert str(e.value).startswith(f"[job] dump_folder: {folder} is in use by another job (pid {os.getpid()} on "
                                   f"host {socket.gethostname()}, since ")
    folder_lock.check_free(folder, own=str(path))  # the launcher's own workers pass
    lock.release()
    assert not path.exists()
    folder_lock.check_free(folder)

    path.write_text(json.dumps({"host": socket.gethostname(), "pid": dead_pid(), "start": "1"}))  # killed job
    folder_lock.check_free(folder)
    lock = folder_lock.acquire(folder)
    assert lock.took_over["start"] == "1" and json.loads(path.read_text())["pid"] == os.getpid()
    lock.release()

    path.write_text(json.dumps({"host": "elsewhere", "pid": dead_pid(), "since": "then"}))  # cannot be checked
    with pytest.raises(folder_lock.FolderBusy, match="on host elsewhere, since then.*that host cannot be checked "
                                                     "from here; if that job is gone, delete the lock file"):
        folder_lock.acquire(folder)
    path.write_text("{")  # cut short
    with pytest.raises(folder_lock.FolderBusy, match="cannot be read; delete it if no job runs there"):
        folder_lock.acquire(folder)


def test_launcher_refuses_a_held_dump_folder_before_any_worker_starts(tmp_path):
    """The launcher's own hold (two jobs past their pre-flights at once): one line, exit 2, no worker."""
    lock = folder_lock.acquire(str(tmp_path / "job"))  # this test process is the other, live job
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "titan_foremoe.distributed.launch", "--nproc_per_node=1", "-m",
             "titan_foremoe.train", "--job.config_file", str(CPU), f"--job.dump_folder={tmp_path / 'job'}",
             "--parallelism.expert_parallel_degree=1"],
            cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        lock.release()
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith(f"launch error: [job] dump_folder: {tmp_path / 'job'} is in use by another job "
                                  f"(pid {os.getpid()} on host {socket.gethostname()}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "step" not in proc.stdout
    (tmp_path / "file").write_text("")  # a folder that cannot hold the lock: one line too (no traceback)
    proc = subprocess.run(
        [sys.executable, "-m", "titan_foremoe.distributed.launch", "--nproc_per_node=1", "-m",
         "titan_foremoe.train", "--job.config_file", str(CPU), f"--job.dump_folder={tmp_path / 'file' / 'job'}"],
        cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stderr.startswith("launch error: [job] dump_folder: cannot create its lock file (")


@pytest.mark.parametrize("target", ["ctrl-c", "scheduler"])
def test_stop_signal_ends_in_one_line_naming_checkpoint_and_resume_command(tmp_path, target):
    """Ctrl-C (SIGINT to the launcher's process group: the workers run in sessions of their own) or a scheduler's
    SIGTERM to every process of the job: one line, exit 128 + signal, torchrun's traceback in DUMP/launch.log."""
    log, dump = tmp_path / "out.log", tmp_path / "job"
    sig = signal.SIGINT if target == "ctrl-c" else signal.SIGTERM
    with running(dump, log, "--checkpoint.enable=true", "--checkpoint.interval=1") as (launcher, workers):
        if target == "ctrl-c":
            os.killpg(launcher.pid, sig)
        else:
            for pid in [launcher.pid, *workers]:
                os.kill(pid, sig)
        assert launcher.wait(60) == 128 + sig, log.read_text()[-3000:]
    text = log.read_text()
    after = text[text.rindex("step   3"):]
    assert "Traceback" not in after and "SignalException" not in after and "KeyboardInterrupt" not in after, after
    (line,) = [x for x in after.splitlines() if x.startswith("launch")]
    step = max(int(p.name.split("-")[1]) for p in (dump / "checkpoint").iterdir() if (p / ".metadata").exists())
    assert line.startswith(f"launch: stopped by {sig.name} (to ")
    assert f"; last complete checkpoint {dump}/checkpoint/step-{step}; resume with: " in line and step >= 2
    assert f"CONFIG_FILE={CPU} {ROOT}/run_train.sh --job.dump_folder={dump} " in line
    assert line.endswith(f"(torchrun's shutdown messages: {dump}/launch.log)")
    assert "death signal" in (dump / "launch.log").read_text() or target == "scheduler"
    assert not any(x.startswith("[rank") and "Error" in x for x in after.splitlines()), after


def test_ctrl_c_in_the_preflight_leaves_no_temporary_file(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    proc = launch(tmp_path / "job", tmp_path / "out.log", env={"TMPDIR": str(temp)})
    wait_for(lambda: children(proc.pid, "titan_foremoe.config.check"), 30, "the pre-flight")
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    assert proc.wait(30) == 130
    assert list(temp.iterdir()) == []


def test_save_on_signal_finishes_the_step_and_saves_it(tmp_path):
    """``[checkpoint] save_on_signal`` (a scheduler's grace period): SIGTERM to the launcher; the workers end the
    step they are in, save it (no interval checkpoint would have) and stop; the line names that checkpoint."""
    log, dump = tmp_path / "out.log", tmp_path / "job"
    with running(dump, log, "--checkpoint.enable=true", "--checkpoint.interval=100000",
                 "--checkpoint.save_on_signal=true") as (launcher, _):
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 128 + signal.SIGTERM, log.read_text()[-3000:]
    text = log.read_text()
    (saved,) = [p for p in (dump / "checkpoint").iterdir() if (p / ".metadata").exists()]
    assert int(saved.name.split("-")[1]) >= 3
    (line,) = [x for x in text[text.rindex("step   3"):].splitlines() if x.startswith("launch")]
    assert line.startswith(f"launch: stopped by SIGTERM (to the launcher); last complete checkpoint {saved}; "), line
    assert "Traceback" not in text


def test_killed_launcher_of_one_node_stops_both_nodes(tmp_path):
    """Two agents on localhost (``NNODES=2``, one worker each), node 0 hosting the rendezvous store: SIGKILL its
    launcher; its worker dies with it within 10 s, and node 1 (store gone, its worker's peer gone) ends too."""
    from distributed_helpers import free_port

    port = free_port()
    logs = [tmp_path / f"node{r}.log" for r in range(2)]
    start = lambda r: launch(tmp_path / "job", logs[r], "--training.steps=100000", "--metrics.log_freq=1", ngpu=1,
                             env={"NNODES": "2", "NODE_RANK": str(r), "RDZV_ENDPOINT": f"localhost:{port}"})
    nodes = [start(0)]
    workers: list[int] = []
    try:
        wait_for(lambda: not subprocess.run(["bash", "-c", f"echo > /dev/tcp/localhost/{port}"],
                                            capture_output=True).returncode, 120, "node 0's rendezvous store")
        nodes.append(start(1))
        workers = [wait_for(lambda n=n: children(n.pid, "titan_foremoe.train"), 120, "a worker per node")[0]
                   for n in nodes]
        wait_for(lambda: "step   2" in logs[0].read_text() or nodes[0].poll() is not None, 180, "step 2")
        nodes[0].send_signal(signal.SIGKILL)
        wait_for(lambda: not alive(workers[0]), 10, "node 0's worker to die with its launcher")
        assert nodes[1].wait(120) != 0
        wait_for(lambda: not alive(workers[1]), 10, "node 1's worker to end")
    finally:
        for w in workers:
            if alive(w):
                os.kill(w, signal.SIGKILL)
        for n in nodes:
            if n.poll() is None:
                n.kill()
