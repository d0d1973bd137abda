"""Run a function on N gloo ranks in fresh processes (env:// rendezvous).

Ranks fork from a forkserver that imported torch, the CPU patches and the trainer once per test session
(``rank_preload.py``), instead of each importing them (spawn). A rank still starts from a process that ran nothing
but those imports, with the caller's environment, working directory and ``sys.path`` at the call, as a spawned one.
``apply_patches=False`` (tests of unpatched torchtitan) and ``TITAN_FOREMOE_RANKS_SPAWN=1`` spawn as before.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range (32768+) and in a range of this pytest-xdist worker's
    own: between this call and rank 0's bind, no other test's gloo connection or rendezvous (each on an
    ephemeral port, or on the other worker's range) can take it."""
    import random

    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    base = 20000 + 6000 * (int(worker) % 2 if worker.isdigit() else 0)
    for _ in range(100):
        port = random.randrange(base, base + 6000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # the range is taken: any port the kernel gives
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HERE = os.path.dirname(os.path.abspath(__file__))


def _entry(rank: int, world_size: int, port: int, fn, args, apply_patches: bool, env=None) -> None:
    if env is not None:  # forked from the forkserver, whose environment is the one it started with
        os.environ.clear()
        os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1",
    )
    # not started by our launcher: a launcher test run earlier in this pytest process (launch._run sets it for
    # torchrun's workers) would make the trainer's entry point stop at once, its "launcher" not its parent
    os.environ.pop("TITAN_FOREMOE_LAUNCHER_PID", None)
    if apply_patches:
        import torchtitan_patches

        torchtitan_patches.apply_all()
    fn(rank, world_size, *args)
    # The work is done and checked: leave without C++ teardown. Now and then a spawned gloo rank aborts at
    # interpreter exit on torch 2.13 CPU ("terminate called without an active exception", seen under load
    # in tests that share nothing but gloo), which would fail a test whose results are already written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_forkserver() -> None:
    """Start the forkserver (once) with ``rank_preload`` importable. Python 3.11's forkserver ignores the caller's
    ``sys.path`` for its preload (a rank gets it, with the working directory, when it is forked) and imports what
    it can: PYTHONPATH names this folder and the repository while it starts."""
    multiprocessing.set_forkserver_preload(["rank_preload"])
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([HERE, os.path.dirname(HERE), *([saved] if saved else [])])
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if saved is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = saved


def run_ranks(fn, world_size: int, *args, apply_patches: bool = True, crash_retries: int = 0) -> None:
    """``fn(rank, world_size, *args)`` on every rank; raises if any rank fails. ``crash_retries``: runs again
    (fresh ranks, a new port) when a rank was killed by a signal, at most that many times, saying so on stderr;
    a rank that raised or exited non-zero fails at once. For ``exact`` only: its 4-rank gloo runs on torch 2.13
    CPU die about once in several CI runs with ``malloc(): unaligned tcache chunk detected`` (SIGABRT) or SIGSEGV,
    in functional collectives, never with a wrong result (docs/testing.md; cause not found)."""
    for attempt in range(crash_retries + 1):
        try:
            return _run_ranks(fn, world_size, args, apply_patches)
        except mp.ProcessExitedException as e:
            if attempt == crash_retries or e.exit_code is None or e.exit_code >= 0:
                raise
            print(f"run_ranks: {e} (killed by a signal): running the ranks again ({attempt + 1} of {crash_retries})",
                  file=sys.stderr, flush=True)


SIGNAL_EXIT = re.compile(r"exitcode: -(?!15\b)\d+")  # a rank killed by a signal (-15: torchrun stopping the rest)


def killed_by_signal(out: str, launch_log: Path | None = None) -> bool:
    """torchrun reported a rank killed by a signal (SIGABRT, SIGSEGV), in ``out`` or in ``launch_log``: the known
    gloo heap crash of 4-rank CPU jobs (docs/testing.md), which a ``run_train.sh`` job's test may run once more."""
    return bool(SIGNAL_EXIT.search(out) or (launch_log is not None and launch_log.exists()
                                            and SIGNAL_EXIT.search(launch_log.read_text())))


def rerun_if_killed(run, folder: Path, who: str) -> subprocess.CompletedProcess:
    """``run()``, a ``run_train.sh`` job writing under ``folder``; once more, ``folder`` removed first, when it
    failed with a rank killed by a signal (``killed_by_signal``, on the screen or in ``folder/launch.log``), saying
    so on stderr as ``who``. Any other failure, and a second crash, is returned as it is."""
    p = run()
    if p.returncode != 0 and killed_by_signal(p.stdout + p.stderr, folder / "launch.log"):
        print(f"{who}: a rank was killed by a signal (the known gloo crash, docs/testing.md): running the job "
              "again (1 of 1)", file=sys.stderr)
        shutil.rmtree(folder, ignore_errors=True)
        p = run()
    return p


def _run_ranks(fn, world_size: int, args: tuple, apply_patches: bool) -> None:
    port = free_port()
    if not apply_patches or os.environ.get("TITAN_FOREMOE_RANKS_SPAWN") == "1":
        mp.start_processes(_entry, args=(world_size, port, fn, args, apply_patches), nprocs=world_size,
                           start_method="spawn")
        return
    _start_forkserver()
    mp.start_processes(_entry, args=(world_size, port, fn, args, True, dict(os.environ)), nprocs=world_size,
                       start_method="forkserver")


def full(t: torch.Tensor) -> torch.Tensor:
    """A detached full copy of a (DTensor) parameter or gradient."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def logical(name: str, p: torch.Tensor, rows_LE) -> torch.Tensor:
    """A full expert weight's rows in logical order (``rows_LE``: ``physical_rows_LE`` of the run's owners;
    None or a non-expert parameter: unchanged)."""
    if rows_LE is None or "inner_experts" not in name:
        return p
    return p[torch.as_tensor(rows_LE[int(name.split(".")[1])])]


def sft_step(trainer) -> dict:
    """One supervised step's micro-steps on this rank (no optimizer step): the global loss, every full
    gradient, and the parameters it started from (what a single-process reference recomputes)."""
    params = {name: full(p) for name, p in trainer.model.named_parameters()}
    schedule = trainer.build_step(0)
    local = torch.tensor(float(sum(m.batch.num_label_tokens for m in schedule)))
    torch.distributed.all_reduce(local)
    loss = torch.zeros(())
    for micro in schedule:
        loss += trainer.run_micro_step(micro, float(local))
    torch.distributed.all_reduce(loss)
    grads = {name: full(p.grad) for name, p in trainer.model.named_parameters()}
    return {"loss": float(loss) / float(local), "grads": grads, "params": params}


def train_recording_samples(trainer, rank: int, world_size: int, samples_per_prompt: int) -> tuple[dict, list]:
    """Train an embedded-rollout ``trainer`` to the end, recording every step's rollout as engine samples
    (group ids per step, rank and prompt); returns its metrics and all ranks' samples in the file importer's
    global row order (step, then data-parallel rank, then the rank's rows). Collective."""
    import torch.distributed as dist

    from titan_foremoe.rollouts.export import samples_from_rollout

    captured = []
    generate = trainer.embedded.generate

    def recording(step):
        rollout, examples = generate(step)
        groups = [f"s{step}r{rank}p{i // samples_per_prompt}" for i in range(len(examples))]
        captured.append(samples_from_rollout(rollout, answers=[ex.answer for ex in examples], groups=groups))
        return rollout, examples

    trainer.embedded.generate = recording
    metrics = trainer.train()
    trainer.close()
    gathered = [None] * world_size
    dist.all_gather_object(gathered, captured)
    return metrics, [s for step in range(len(captured)) for r in range(world_size) for s in gathered[r][step]]


def end_rank(out: str, rank: int, result: dict, dead_peer: bool = False) -> None:
    """A rank's last step in a weight-sync test: its ``result`` to ``out/rank<r>.json`` (``rank_results``), then
    the process group torn down, or skipped when a peer died (gloo's teardown would wait for it)."""
    import json

    import torch.distributed as dist

    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if dead_peer:
        os._exit(0)
    dist.destroy_process_group()


def rank_results(folder, world: int) -> list:
    """Every rank's ``end_rank`` result (None where a rank died before writing it)."""
    import json

    paths = [os.path.join(str(folder), f"rank{i}.json") for i in range(world)]
    return [json.load(open(p)) if os.path.exists(p) else None for p in paths]
