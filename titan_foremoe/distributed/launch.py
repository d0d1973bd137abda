"""torchrun, plus what it lacks on several nodes: missing nodes named in time, and a quiet exit.

``python -m titan_foremoe.distributed.launch [torchrun arguments] -m titan_foremoe.train --job.config_file F ...``
(what ``run_train.sh`` runs) is ``torch.distributed.run`` in this process, plus:

* **A node that never arrives** (never started, or its pre-flight failed). torchrun's c10d rendezvous waits its
  ``join_timeout`` (600 s) without a word, then ends in a traceback. Here the timeout is the job's
  ``[comm] join_timeout_seconds`` (given to the rendezvous as ``join_timeout`` and ``read_timeout`` unless
  ``--rdzv-conf`` sets them); every agent records its ``--node_rank`` in the rendezvous store as it joins; a
  notice at half the timeout names the node ranks still missing and the timeout ends in one line naming them
  (exit 1). A node that cannot reach the store host in that time names the endpoint. A node whose pre-flight
  failed posts its line (``--report-failure``, from ``run_train.sh``) and the waiting agents stop at once with it.
* **The exit**. After the workers succeed, torchrun's agents pass an exit barrier; the agent that hosts the
  rendezvous TCPStore then exits and takes the store with it, while another agent may still send its keep-alive
  heartbeat or close the rendezvous through it: a C++ ``recvVector failed`` (heartbeat) or
  ``recvValueWithTimeout failed`` (close) stack on that node after a run that succeeded (issue 23; certain when
  that agent's shutdown is delayed, as ``tests/test_launch.py`` does). Here every agent counts itself out in the
  store after torchrun has shut its rendezvous down (heartbeats stopped), and the store host leaves only when all
  have (at most ``_LEAVE_WAIT_S``).
* **A rendezvous port held by another program** (one that accepts connections but is no store): torchrun would
  wait on it forever, then blame a node that "has not started". Before torchrun starts, a local endpoint's port
  that is taken and does not answer as a store is refused in one line naming the port and the fix; a remote one
  that does not answer as a store within ``join_timeout_seconds`` likewise (``endpoint_problem``).
* **A killed launcher**. Workers run in sessions of their own; each asks the kernel to kill it when this process
  dies (``parent_death.py``), so a SIGKILLed launcher leaves no worker training unsupervised.
* **One job per dump folder**. node_rank 0 holds ``DUMP/.titan_foremoe.lock`` for the job's life
  (``folder_lock.py``); a second job on that folder stops in one line naming the holder (exit 2).
* **A stop signal** (SIGTERM from a scheduler, Ctrl-C) to this process or a worker ends in one line naming the signal,
  the last complete checkpoint and the resume command; torchrun's shutdown messages go to ``DUMP/launch.log``
  (``stop_signals.py``).
* **A failed worker**: the screen ends with the one line of the first worker to fail in time (``root_failure``,
  ``worker_exits.py``: not a bystander torchrun stopped after it, nor a peer that failed in a collective because
  it died): the line of a worker that stopped on bad input (exit 2), ``rank R failed in phase ...`` of one that
  raised, or a worker killed by a signal named with the signal and its last phase (exit 1: a crash never ends with
  a stop's 143 and a resume command). Every worker's stderr tail goes to ``DUMP/worker_logs/rank-R.stderr`` (named
  in the line), torchrun's ``ChildFailedError`` report to ``DUMP/launch.log``.

Cost: a few store operations per agent at start and exit, two per second while nodes are missing, none per step;
the store host's exit waits for the slowest agent's rendezvous shutdown (milliseconds when all finish together).
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from dataclasses import dataclass

from ..train.failures import describe_os_error, failure_time
from .folder_lock import FolderBusy
from .parent_death import LAUNCHER_PID_ENV
from .stop_signals import ShutdownLog, stop_signal, stopped_line
from .worker_exits import ExitClock, keep_stderr, last_phase

_PREFIX = "titan_foremoe/launch/"
ALLOC_ENV = "PYTORCH_CUDA_ALLOC_CONF"
_LEAVE_WAIT_S = 30.0  # the store host waits this long for the other agents to count themselves out


@dataclass
class _Rendezvous:
    """The rendezvous store this agent created, and whether it hosts it (filled in by ``_record_store``)."""

    store: object | None = None
    is_host: bool = False


_rdzv = _Rendezvous()


def _record_store(node_rank: int, nnodes: int, notice_after_s: float | None, where: str) -> None:
    """Wrap the TCPStore constructor torchrun's c10d rendezvous backend calls: keep the store, note whether this
    process hosts it, and record this node's rank in it as soon as it is reachable. ``notice_after_s``: when
    nodes are still missing then, say which (once; the wait goes on)."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as backend

    real = backend.TCPStore

    def notice() -> None:
        try:
            if int(_rdzv.store.add(f"{_PREFIX}arrived", 0)) < nnodes:
                print(f"launch: {where}: still waiting after {notice_after_s:g} s: "
                      f"{missing_nodes(_rdzv.store, nnodes, 'yet')}", file=sys.stderr, flush=True)
        except Exception:  # the store went away: torchrun reports that
            pass

    def make(host, port, *args, is_master=False, **kwargs):
        store = real(host, port, *args, is_master=is_master, **kwargs)
        _rdzv.store, _rdzv.is_host = store, bool(is_master)
        store.set(f"{_PREFIX}node/{node_rank}", socket.gethostname())
        store.add(f"{_PREFIX}arrived", 1)
        if notice_after_s is not None and nnodes > 1:
            timer = threading.Timer(notice_after_s, notice)
            timer.daemon = True
            timer.start()
            threading.Thread(target=_watch_failures, args=(store, nnodes, where), daemon=True,
                             name="foremoe-launch-watch").start()
        return store

    backend.TCPStore = make


def _watch_failures(store, nnodes: int, where: str, poll_s: float = 1.0) -> None:
    """While nodes are missing, stop this agent as soon as one of them reports that it will not come
    (``report_failure``: its pre-flight failed). The store host stops last, so that every waiting agent can
    read the report before the store goes (one ``add`` per agent per second while waiting, none after)."""
    try:
        while int(store.add(f"{_PREFIX}arrived", 0)) < nnodes:
            if int(store.add(f"{_PREFIX}failed", 0)) > 0:
                reports = [store.get(f"{_PREFIX}failed/{r}").decode() for r in range(nnodes)
                           if store.check([f"{_PREFIX}failed/{r}"])]
                print(f"launch error: {where}: {reports[0] if reports else 'a node reported a failure'}",
                      file=sys.stderr, flush=True)
                if _rdzv.is_host:
                    time.sleep(3 * poll_s)
                os._exit(2)
            time.sleep(poll_s)
    except Exception:  # the store went away: torchrun reports that
        pass


def report_failure(endpoint: str, node_rank: int, line: str, wait_s: float) -> bool:
    """Tell the agents waiting at ``endpoint`` that node ``node_rank`` will not join, and why (``line``: its
    pre-flight's error). Waits up to ``wait_s`` for the store host to listen; False when nobody was there."""
    from datetime import timedelta

    from torch.distributed import TCPStore
    from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    deadline, said = time.monotonic() + wait_s, False
    while True:  # plain sockets first: torch's client logs a C++ stack per failed try
        try:
            socket.create_connection((host, port), timeout=2).close()
            break
        except OSError:
            if time.monotonic() >= deadline:
                return False
            if not said:
                print(f"launch: waiting up to {wait_s:g} s for the rendezvous at {endpoint} to tell the other nodes "
                      "that this one stops", file=sys.stderr, flush=True)
                said = True
            time.sleep(0.5)
    try:
        store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
        store.set(f"{_PREFIX}failed/{node_rank}",
                  f"node_rank {node_rank} on {socket.gethostname()} stopped before joining: {line}")
        store.add(f"{_PREFIX}failed", 1)
        return True
    except Exception:
        return False


def job_config(script_args: list[str]):
    """The config of the job the workers run; None when they do not run our trainer or it does not load (the
    workers will say what is wrong with it)."""
    from ..config.loader import ConfigError, load_config
    from ..train.__main__ import split_config_file

    if "--job.config_file" not in " ".join(script_args).replace("=", " ").split():
        return None
    path, overrides = split_config_file(script_args)
    try:
        return load_config(path, overrides)
    except ConfigError:
        return None


def join_timeout_s(script_args: list[str], default: int | None = None) -> int | None:
    """``[comm] join_timeout_seconds`` of the job the workers run (None when they do not run our trainer)."""
    cfg = job_config(script_args)
    return default if cfg is None else cfg.comm.join_timeout_seconds


def lock_dump_folder(cfg, node_rank: int):
    """On node_rank 0: hold the job's dump folder for the launcher's life (``folder_lock``); the workers of every
    node are told through ``LOCK_ENV`` (their rank 0 takes no lock of its own). None when there is nothing to lock; ``FolderBusy`` when another job has it."""
    from . import folder_lock

    if cfg is None:
        return None
    os.environ[folder_lock.LOCK_ENV] = folder_lock.lock_path(cfg.job.dump_folder)  # rank 0 may be on any node
    if node_rank != 0:
        return None
    lock = folder_lock.acquire(cfg.job.dump_folder)
    if lock.took_over:
        h = lock.took_over
        print(f"launch: {cfg.job.dump_folder}: took over the lock of pid {h.get('pid')} on this host, which is no "
              "longer running", file=sys.stderr, flush=True)
    return lock


def _with_rdzv_conf(conf: str, **values: int) -> str:
    """``--rdzv-conf`` with ``values`` added where the user did not set them."""
    given = {item.split("=", 1)[0] for item in conf.split(",") if item}
    extra = [f"{k}={v}" for k, v in values.items() if k not in given]
    return ",".join([c for c in [conf] if c] + extra)


def missing_nodes(store, nnodes: int, waited: str) -> str:
    """Which ``--node_rank``s have not recorded themselves in the store, in words."""
    arrived = int(store.add(f"{_PREFIX}arrived", 0))
    here = [r for r in range(nnodes) if store.check([f"{_PREFIX}node/{r}"])]
    gone = [r for r in range(nnodes) if r not in here]
    if len(here) != arrived or not gone:  # ranks given twice, or no --node_rank: count only
        return f"{nnodes - arrived} of {nnodes} nodes did not join {waited}"
    names = ", ".join(f"node_rank {r} on {store.get(f'{_PREFIX}node/{r}').decode()}" for r in here)
    s = "s" if len(gone) > 1 else ""
    return (f"node_rank{s} {', '.join(map(str, gone))} did not join {waited} "
            f"({len(here)} of {nnodes} nodes arrived: {names})")


def wait_for_store_host(endpoint: str, rdzv_conf: str, timeout_s: float) -> str | None:
    """On a node that does not host the rendezvous store: wait up to ``timeout_s`` for its port to accept a
    connection (plain sockets: torch's own client logs a C++ stack per failed try). None when reachable."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    is_host = {"1": True, "true": True, "0": False, "false": False}.get(
        dict(item.split("=", 1) for item in rdzv_conf.split(",") if "=" in item).get("is_host", "").lower())
    if is_host or (is_host is None and _matches_machine_hostname(host)):
        return None  # this node hosts it (torchrun falls back to a client when another local agent does)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=2).close()
            return None
        except OSError as e:
            if time.monotonic() >= deadline:
                return e.strerror or str(e)
            time.sleep(0.5)


def store_answers(host: str, port: int, wait_s: float) -> str | None:
    """None when ``host:port`` answers as a c10d store within ``wait_s``, else why not. A program that is not a
    store accepts the connection and never replies: torchrun would wait on it without a word (issue 40)."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    outcome: list = []

    def probe() -> None:
        try:
            store = TCPStore(host, port, is_master=False, timeout=timedelta(seconds=wait_s), wait_for_workers=False)
            store.check([f"{_PREFIX}probe"])
            outcome.append(None)
        except Exception as e:  # refused, reset, or no reply in time
            outcome.append(str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)

    thread = threading.Thread(target=probe, daemon=True, name="foremoe-store-probe")
    thread.start()
    thread.join(wait_s + 2)
    return outcome[0] if outcome else f"no reply in {wait_s:g} s"


def endpoint_problem(endpoint: str, rdzv_conf: str, wait_s: float) -> str | None:
    """Before torchrun starts: a rendezvous port on this host held by something that does not answer as a store
    (a free port, port 0 or another local agent's store are fine), or a remote one that does not answer as a store
    within ``wait_s`` (``join_timeout_seconds``), in words naming the port and the fix; None when fine.
    Cost: one ``bind`` (local), one store round trip when the port is taken."""
    from torch.distributed.elastic.rendezvous.utils import _matches_machine_hostname, parse_rendezvous_endpoint

    if not endpoint:
        return None  # torchrun picks its own
    host, port = parse_rendezvous_endpoint(endpoint, default_port=29400)
    if port == 0:
        return None
    if _matches_machine_hostname(host):
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
                return None  # free: torchrun's store will listen there
            except OSError:
                pass
        why = store_answers(host, port, min(wait_s, 10.0))
        if why is None:
            return None  # another agent's store on this host: torchrun joins it
        return (f"port {port} on this host is held by a program that does not answer as a rendezvous store ({why}); "
                f"torchrun would wait on it without a word: stop that program (`ss -ltnp 'sport = :{port}'` names "
                "it) or choose another port (RDZV_ENDPOINT=localhost:0 picks a free one)")
    why = store_answers(host, port, wait_s)
    if why is None:
        return None
    return (f"{host}:{port} does not answer as a rendezvous store within {wait_s:g} s ([comm] join_timeout_seconds;"
            f" {why}): the node at that endpoint has not started, its pre-flight failed, or another program holds "
            "the port")


def _leave(nnodes: int, wait_s: float) -> None:
    """Count this agent out; the store host waits until every agent has (so none talks to a closed store)."""
    store = _rdzv.store
    if store is None or nnodes <= 1:
        return
    try:
        store.add(f"{_PREFIX}left", 1)
        deadline = time.monotonic() + wait_s
        while _rdzv.is_host and int(store.add(f"{_PREFIX}left", 0)) < nnodes and time.monotonic() < deadline:
            time.sleep(0.05)
    except Exception:  # a peer gone: nothing left to protect
        pass


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.run import parse_args, parse_min_max_nnodes

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--report-failure"]:  # run_train.sh, after a failed pre-flight: ENDPOINT NODE_RANK WAIT_S LINE
        endpoint, rank, wait_s, line = argv[1:5]
        report_failure(endpoint, int(rank), line, float(wait_s))
        return 0
    args = parse_args(argv)
    _, nnodes = parse_min_max_nnodes(args.nnodes)
    cfg = job_config(args.training_script_args)
    timeout = None if cfg is None else cfg.comm.join_timeout_seconds
    if timeout is not None and args.rdzv_backend == "c10d":
        args.rdzv_conf = _with_rdzv_conf(args.rdzv_conf, join_timeout=timeout, read_timeout=timeout)
    where = f"rendezvous {args.rdzv_endpoint or 'localhost'} (--rdzv-id {args.rdzv_id})"
    waited = f"{timeout} s ([comm] join_timeout_seconds)" if timeout is not None else "torchrun's join timeout"
    node_rank = args.node_rank
    if args.rdzv_backend == "c10d":
        args.node_rank = 0  # c10d ignores it (and says so); we use it to name the nodes
    if nnodes > 1 and args.rdzv_backend == "c10d" and timeout is not None:
        problem = wait_for_store_host(args.rdzv_endpoint, args.rdzv_conf, timeout)
        if problem is not None:
            print(f"launch error: {where}: cannot reach the rendezvous store within {waited} ({problem}); the node "
                  "at that endpoint has not started, or its pre-flight failed", file=sys.stderr,
                  flush=True)
            return 1
    if args.rdzv_backend == "c10d" and (nnodes == 1 or timeout is not None):
        problem = endpoint_problem(args.rdzv_endpoint, args.rdzv_conf, timeout if timeout is not None else 60)
        if problem is not None:
            print(f"launch error: {where}: {problem}", file=sys.stderr, flush=True)
            return 1
    try:
        lock = lock_dump_folder(cfg, node_rank)
    except FolderBusy as e:
        print(f"launch error: {e}", file=sys.stderr, flush=True)
        return 2
    except OSError as e:  # run_train.sh's pre-flight names an unwritable folder first
        print(f"launch error: [job] dump_folder: cannot create its lock file ({describe_os_error(e)})",
              file=sys.stderr, flush=True)
        return 2
    try:
        return _run(args, cfg, nnodes, node_rank, timeout, where, waited)
    finally:
        if lock is not None:
            lock.release()


def allocator_env(env, cuda: bool) -> dict[str, str]:
    """What the workers' environment gains for torch's CUDA caching allocator: growable segments on CUDA
    (the rollout, KV cache and unsharded weights, and the update, activations and log-prob chunks, free and
    allocate blocks of very different sizes every step, which fixed segments fragment: docs/memory.md), unless
    the user set the variable, even empty; nothing without CUDA. Decided here, where torch is imported anyway,
    not in ``run_train.sh`` (a probe there cost one more torch import per launch)."""
    return {ALLOC_ENV: "expandable_segments:True"} if cuda and ALLOC_ENV not in env else {}


def _stopped(sig: int, who: str, cfg, log: ShutdownLog | None, nnodes: int) -> int:
    """A stop signal (to this launcher or to a worker) in one line; exit code ``128 + signal``, as a shell's."""
    from ..config.preflight import checkpoint_folder

    _leave(nnodes, 5.0)
    folder = checkpoint_folder(cfg) if cfg is not None and cfg.checkpoint.enable else None
    print(stopped_line(sig, who, folder, log.path if log is not None else "not kept"), file=sys.stderr, flush=True)
    return 128 + sig


def failed_at(failure, clock: ExitClock | None) -> float | None:
    """When a worker's failure began, in wall seconds: the moment it caught its error (``failures.note_failure_time``,
    beside its error file) or, for a worker killed without a word, its exit (``ExitClock``); None when unknown."""
    times = [t for t in (failure_time(failure.error_file), clock.exited_at(failure.pid) if clock else None)
             if t is not None]
    return min(times) if times else None


_PEER_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe", "remote process exited",
              "communicator was aborted", "recvvalue")
_PEER_LAG_S = 1.0


def lost_peer(failure) -> bool:
    """The worker's error says a peer went away (gloo's closed connection, NCCL's aborted communicator): the
    consequence of another worker's death, not a cause."""
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message or "")
    return any(p in message.lower() for p in _PEER_LOST)


def root_failure(e, clock: ExitClock | None = None):
    """``(rank, ProcessFailure)`` that caused a ``ChildFailedError``: the first failure in time (``failed_at``: the
    agent stops the others only after it saw one, and a peer notices a dead worker only once it is gone). Without
    sub-second times (torchrun's own are whole seconds, and a bystander's is when its exit was read) a stop
    signal's exit code comes last (torchrun's SIGTERM to the others), then a worker that exited 2 (bad input:
    every rank may find it, and one can be stopped by that SIGTERM before it exits 2 itself), then one killed by
    a signal (its peers then fail in their next collective), then the oldest timestamp."""

    def key(item):
        rank, f = item
        at = failed_at(f, clock)
        if at is not None and f.exitcode > 0 and lost_peer(f):
            at += _PEER_LAG_S  # its note can beat the exit clock of the worker whose death it reports
        return (at is None, at or 0.0, stopped(f), f.exitcode != 2, f.exitcode >= 0, f.timestamp, rank)

    return min(e.failures.items(), key=key)


def stopped(failure) -> bool:
    """The worker exited by a stop signal before any failure of its own (none noted: ``note_failure_time``)."""
    return stop_signal(failure.exitcode) is not None and failure_time(failure.error_file) is None


def failure_line(e, log_path: str, clock: ExitClock | None = None, store: tuple[str, int] | None = None,
                 kept: dict[int, str] | None = None) -> tuple[str, int]:
    """The first failed worker's one line, and the launcher's exit code: a worker that stopped on bad input or
    values (exit 2) left its line in its error file (``failures.record_line``), one that raised left
    ``rank R failed in phase ...: ...`` (``@record``); one killed by a signal left nothing: it is named with the
    signal and the phase of its last heartbeat (``store``: the workers' store endpoint). Every crash exits 1
    (never a stop's 128 + signal); the line names the file with the rank's stderr (``kept``) and torchrun's report
    (``log_path``)."""
    import signal as signals

    rank, first = root_failure(e, clock)
    message = first.message.get("message", "") if isinstance(first.message, dict) else str(first.message or "")
    message = message.strip().splitlines()[0] if message.strip() else ""
    line_file = os.path.isfile(first.error_file) and isinstance(first.error_file_data.get("message"), str)
    if message and (first.exitcode == 2 or line_file):
        return message, 2  # its line (record_line), even when torchrun's SIGTERM came before its own exit 2
    where = f"its stderr: {kept[rank]}; " if kept and rank in kept else ""
    if first.exitcode < 0 or first.error_file == "<N/A>" or not message:
        try:
            how = f"was killed by {signals.Signals(-first.exitcode).name}" if first.exitcode < 0 else \
                f"exited with code {first.exitcode} without a Python error"
        except ValueError:
            how = f"exited with code {first.exitcode}"
        if failure_time(first.error_file) is not None:  # it caught an error, then torchrun stopped it mid-report
            how = f"failed (its error is in its stderr), then exited with code {first.exitcode} before reporting it"
        phase = last_phase(store, rank)
        hint = " (out of memory? see the kernel log: dmesg)" if first.exitcode == -signals.SIGKILL else ""
        return (f"error: rank {rank} (pid {first.pid}) {how}{' ' + phase if phase else ''}{hint}; "
                f"{where}torchrun's report: {log_path}", 1)
    message = message.split(": ", 1)[1] if message.startswith("RuntimeError: rank ") else message
    return f"error: {message} ({where}torchrun's report: {log_path})", 1


def _run(args, cfg, nnodes: int, node_rank: int, timeout: int | None, where: str, waited: str) -> int:
    """torchrun's ``run``, its failures in one line where we can name them."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError, RendezvousTimeoutError
    from torch.distributed.run import run

    _record_store(node_rank, nnodes, timeout / 2 if timeout is not None else None, where)
    clock = ExitClock().install()  # each worker's exit time: the first failure in time is the root cause
    os.environ[LAUNCHER_PID_ENV] = str(os.getpid())  # the workers end with this process (parent_death.py)
    import torch

    os.environ.update(allocator_env(os.environ, torch.cuda.is_available()))  # before any worker starts
    log = None
    if cfg is not None:  # torchrun's shutdown after a stop signal: to this file, not the screen
        log = ShutdownLog(os.path.join(os.path.abspath(cfg.job.dump_folder),
                                       "launch.log" if node_rank == 0 else f"launch-node{node_rank}.log")).install()
    try:
        record(run)(args)
    except SignalException as e:
        if log is not None:
            log.keep_traceback(e)
        return _stopped(int(e.sigval), "to the launcher", cfg, log, nnodes)
    except RendezvousTimeoutError:
        what = f"the nodes did not all join within {waited}"
        try:
            what = missing_nodes(_rdzv.store, nnodes, f"within {waited}") if _rdzv.store is not None else what
        except Exception:  # the store host left too
            pass
        print(f"launch error: {where}: {what}; start the missing nodes, or read their output (a node whose "
              "pre-flight fails exits before it joins)", file=sys.stderr, flush=True)
        return 1
    except RendezvousConnectionError as e:
        if _rdzv.store is not None:  # reached once, gone now: its host stopped (killed launcher, lost node)
            if log is not None:
                log.keep_traceback(e)
            print(f"launch error: {where}: lost the rendezvous store during the job (the node hosting it stopped or "
                  f"was killed); this node's workers are stopped too (details: "
                  f"{log.path if log is not None else 'not kept'})", file=sys.stderr, flush=True)
            return 1
        cause = str(e.__cause__ or e).strip().splitlines()[0]
        print(f"launch error: {where}: cannot reach the rendezvous store within {waited} ({cause}); the node at "
              "that endpoint has not started, or its pre-flight failed", file=sys.stderr, flush=True)
        return 1
    except ChildFailedError as e:
        kept = keep_stderr(clock, os.path.join(os.path.abspath(cfg.job.dump_folder), "worker_logs")) \
            if cfg is not None else {}
        root = root_failure(e, clock)[1]
        sig = stop_signal(root.exitcode) if stopped(root) else None
        if sig is not None:  # the first worker to exit was sent SIGTERM / SIGINT from outside (a scheduler)
            if log is not None:
                log.keep_traceback(e)
            return _stopped(sig, "to a worker", cfg, log, nnodes)
        _leave(nnodes, 5.0)  # the other agents stop their workers too
        if log is None:
            raise  # torchrun's root-cause report (record wrote it)
        log.keep_traceback(e)  # torchrun's report (every failed worker) goes to the log; the screen ends with
        line, code = failure_line(e, log.path, clock, clock.store, kept)  # the failing worker's own line
        print(line, file=sys.stderr, flush=True)
        return code
    _leave(nnodes, _LEAVE_WAIT_S)
    return 0


if __name__ == "__main__":
    from .process_exit import run_and_exit

    run_and_exit(main)  # torchrun's keep-alive thread may be inside a store call: no teardown (process_exit.py)
