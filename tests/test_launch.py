"""Two torchrun agents on localhost through ``run_train.sh`` (issue 23, what crosses nodes), each bounded in time.

* a node that never joins: the node that did names it at half of ``[comm] join_timeout_seconds`` and stops at the
  timeout with one line naming the missing ``node_rank`` (torchrun alone waits 600 s, then prints a traceback);
* a node whose pre-flight fails tells the waiting node at once (its line, its ``node_rank``): no timeout to wait;
* two nodes with different overrides stop at start-up with the key named on each node, and no step runs;
* a successful two-node run exits 0 on both nodes without a C++ store stack, even when the agent that does not
  host the rendezvous store is slow to shut its rendezvous down (delayed here by 2 s through ``sitecustomize``:
  plain torchrun then prints ``recvVector failed`` from that agent's keep-alive heartbeat, or a failed
  ``recvValue`` from its rendezvous close, see docs/failures.md); its checkpoint carries the model facts a later
  pre-flight compares (a ``top_k`` change refused).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from distributed_helpers import free_port

from titan_foremoe.config import ConfigError, load_config
from titan_foremoe.config.preflight import check_resume

ROOT = Path(__file__).resolve().parents[1]
CPU = ROOT / "train_configs" / "debug_tiny_cpu.toml"
STACK = ("recvVector", "recvValue", "sendBytes failed", "frame #")
# the agent's rendezvous shutdown, slowed where DELAY_RDZV_SHUTDOWN is set (imported by every python started)
SITECUSTOMIZE = """
import os
if os.environ.get("DELAY_RDZV_SHUTDOWN"):
    import time
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr
    _shutdown = dr.DynamicRendezvousHandler.shutdown
    def _slow(self):
        time.sleep(float(os.environ["DELAY_RDZV_SHUTDOWN"]))
        return _shutdown(self)
    dr.DynamicRendezvousHandler.shutdown = _slow
"""


def agent(node_rank: int, port: int, dump: Path, *overrides: str, env: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHON": sys.executable, "NGPU": "1", "NNODES": "2", "NODE_RANK": str(node_rank),
           "RDZV_ENDPOINT": f"localhost:{port}", "CONFIG_FILE": str(CPU), **(env or {})}
    return subprocess.Popen(
        [str(ROOT / "run_train.sh"), f"--job.dump_folder={dump}", "--parallelism.expert_parallel_degree=2",
         "--training.global_batch_size=16", "--training.steps=1", "--metrics.enable_tensorboard=false", *overrides],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """Until the first agent hosts the rendezvous store (so the second one is the store's client)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            socket.create_connection(("localhost", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise AssertionError("the first agent never hosted the rendezvous store")


def finish(*procs: subprocess.Popen, timeout_s: float = 120) -> list[tuple[int, str, str]]:
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=timeout_s)
        out.append((p.returncode, stdout, stderr))
    return out


def test_missing_nodes_and_rdzv_conf_in_words():
    from torch.distributed import HashStore

    from titan_foremoe.distributed.launch import _PREFIX, _with_rdzv_conf, join_timeout_s, missing_nodes

    store = HashStore()
    for rank, host in [(0, "a"), (2, "c")]:
        store.set(f"{_PREFIX}node/{rank}", host)
        store.add(f"{_PREFIX}arrived", 1)
    assert missing_nodes(store, 4, "yet") == ("node_ranks 1, 3 did not join yet "
                                              "(2 of 4 nodes arrived: node_rank 0 on a, node_rank 2 on c)")
    store.add(f"{_PREFIX}arrived", 1)  # a third node gave node_rank 0 or 2 again: only counts can be told
    assert missing_nodes(store, 4, "yet") == "1 of 4 nodes did not join yet"
    assert _with_rdzv_conf("", join_timeout=5) == "join_timeout=5"
    assert _with_rdzv_conf("join_timeout=9,x=1", join_timeout=5, read_timeout=5) == "join_timeout=9,x=1,read_timeout=5"
    assert join_timeout_s(["--job.config_file", str(CPU), "--comm.join_timeout_seconds=7"]) == 7
    assert join_timeout_s(["--job.config_file", str(CPU)]) == 300
    assert join_timeout_s(["script.py", "--lr=1"]) is None


def test_node_that_never_joins_is_named_in_time(tmp_path):
    port, start = free_port(), time.monotonic()
    code, out, err = finish(agent(0, port, tmp_path / "job", "--comm.join_timeout_seconds=6"))[0]
    assert code == 1, err[-3000:]
    lines = [line for line in err.splitlines() if line.startswith("launch")]
    assert len(lines) == 2, err
    assert lines[0].endswith("still waiting after 3 s: node_rank 1 did not join yet (1 of 2 nodes arrived: "
                             f"node_rank 0 on {socket.gethostname()})")
    assert "launch error: rendezvous localhost:" in lines[1]
    assert "node_rank 1 did not join within 6 s ([comm] join_timeout_seconds)" in lines[1]
    assert not any(s in err for s in STACK) and "Traceback" not in err and "step   1" not in out
    # 26 s measured on 2 cores at load average 16 (a pre-flight, 6 s of waiting); torchrun alone: 600 s
    assert time.monotonic() - start < 60


def test_node_whose_preflight_fails_stops_the_others_at_once(tmp_path):
    port, start = free_port(), time.monotonic()
    here = agent(0, port, tmp_path / "job")  # [comm] join_timeout_seconds: 300 s
    failed = agent(1, port, tmp_path / "job", "--model.num_experts=7")  # waits for node 0's store to report
    ((code0, out0, err0), (code1, _, err1)) = finish(here, failed)
    assert code1 == 2 and "[parallelism] expert_parallel_degree" in err1  # its own pre-flight: one line
    assert code0 == 2, err0[-3000:]
    lines = [line for line in err0.splitlines() if line.startswith("launch")]
    assert len(lines) == 1, err0
    assert f"node_rank 1 on {socket.gethostname()} stopped before joining: config error: [parallelism] " \
           "expert_parallel_degree" in lines[0]
    assert not any(s in err0 for s in STACK) and "Traceback" not in err0 and "step   1" not in out0
    assert time.monotonic() - start < 60


def test_nodes_with_different_configs_stop_at_start_up(tmp_path):
    port = free_port()
    a = agent(0, port, tmp_path / "job", "--optimizer.lr=3e-3")
    wait_listening(port, a)
    b = agent(1, port, tmp_path / "job", "--optimizer.lr=1e-3")
    results = finish(a, b)
    line = re.compile(r"error: config and code: ranks disagree on \[optimizer\] lr: rank [01] 0\.00[13]; rank [01] 0\.00[13]$")
    for code, out, err in results:
        assert code == 2 and "Traceback" not in err, err[-3000:]
        lines = err.strip().splitlines()
        assert line.search(lines[-1]), err[-3000:]  # each node's screen ends with it (the launcher repeats it)
        assert sum(bool(line.search(x)) for x in lines[:-1]) == 1, err[-3000:]  # said once by the worker
        assert "step   1" not in out + err


def test_successful_two_node_run_exits_quietly(tmp_path):
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    path = os.pathsep.join([str(tmp_path / "site"), os.environ.get("PYTHONPATH", "")])
    port = free_port()
    host = agent(0, port, tmp_path / "job", "--checkpoint.enable=true")
    wait_listening(port, host)
    late = agent(1, port, tmp_path / "job", "--checkpoint.enable=true",
                 env={"PYTHONPATH": path, "DELAY_RDZV_SHUTDOWN": "2"})
    for code, out, err in finish(host, late):
        assert code == 0, err[-3000:]
        assert not any(s in err for s in STACK), err[-3000:]
    assert (tmp_path / "job" / "summary.json").is_file()
    # the trainer kept the model facts with its checkpoint: a top_k change is refused at the next pre-flight
    assert (tmp_path / "job" / "checkpoint" / "step-1" / "model_facts.json").is_file()
    args = [f"--job.dump_folder={tmp_path / 'job'}", "--checkpoint.enable=true", "--training.steps=2",
            "--parallelism.expert_parallel_degree=2", "--training.global_batch_size=16"]
    assert check_resume(load_config(CPU, args)) == 1
    with pytest.raises(ConfigError, match="saved by a model with top_k = 2, this config builds top_k = 3"):
        check_resume(load_config(CPU, args + ["--model.top_k=3"]))
