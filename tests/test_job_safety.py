"""Issue 31, the job's life on a cluster: workers die with their launcher (SIGKILLed, as a scheduler may)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "train_configs" / "debug_tiny_cpu.toml"


def launch(dump: Path, log: Path, *overrides: str, ngpu: int = 2) -> subprocess.Popen:
    """``run_train.sh`` on ``ngpu`` gloo ranks of the CPU debug job, output to ``log``."""
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": str(ngpu), "CONFIG_FILE": str(CPU)}
    with open(log, "w") as out:
        return subprocess.Popen(
            [str(ROOT / "run_train.sh"), f"--job.dump_folder={dump}", f"--parallelism.expert_parallel_degree={ngpu}",
             "--training.global_batch_size=16", "--metrics.enable_tensorboard=false", *overrides],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


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


def test_workers_die_with_a_sigkilled_launcher(tmp_path):
    log = tmp_path / "out.log"
    launcher = launch(tmp_path / "job", log, "--training.steps=100000", "--metrics.log_freq=1")
    workers: list[int] = []
    try:
        workers = wait_for(lambda: (w := children(launcher.pid, "titan_foremoe.train")) and len(w) == 2 and w,
                           120, "two workers")
        wait_for(lambda: "step   2" in log.read_text() or launcher.poll() is not None, 180, "step 2")
        assert launcher.poll() is None, log.read_text()[-3000:]
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(10)
        start = time.monotonic()
        left = workers
        while left and time.monotonic() - start < 10:
            time.sleep(0.2)
            left = [w for w in left if alive(w)]
        assert not left, f"workers {left} still alive 10 s after the launcher was killed"
    finally:
        for w in workers:  # a failed test leaves nothing behind
            if alive(w):
                os.kill(w, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


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
