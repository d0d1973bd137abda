"""``scripts/slurm/train.sbatch`` under stand-ins of ``srun``, ``scontrol`` and the python run_train.sh calls.

The real run_train.sh runs once per fake node; the stand-in python records the pre-flight and the torchrun
(launch) command line with the environment each node gets, so the test sees exactly what a 2-node job starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "train.sbatch"
CONFIG = f"{ROOT}/./train_configs/debug_tiny_cpu.toml"  # run_train.sh makes a relative CONFIG_FILE absolute
ENV_KEYS = ("NNODES", "NODE_RANK", "NGPU", "RDZV_ENDPOINT", "MAX_RESTARTS", "LOCAL_WORLD_SIZE",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "TITAN_FOREMOE_RESUME_COMMAND")

SCONTROL = """
import sys
assert sys.argv[1:] == ["show", "hostnames", "gpu-a[17-18]"], sys.argv
print("gpu-a17")
print("gpu-a18")
"""
# one task per node, run one after the other, each with its SLURM_NODEID; exit: the worst task's code
SRUN = """
import json, os, subprocess, sys
args = sys.argv[1:]
opts = [a for a in args[: next(i for i, a in enumerate(args) if not a.startswith("--"))]]
with open(os.environ["RECORD"] + "/srun.json", "w") as f:
    json.dump(args, f)
nodes = int(dict(o[2:].split("=", 1) for o in opts)["nodes"])
codes = [subprocess.call(args[len(opts):], env={**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n)})
         for n in range(nodes)]
sys.exit(max(codes))
"""
# the python run_train.sh calls: records each call; FAIL_NODE's pre-flight fails
PYTHON = """
import json, os, sys
keys = %r
with open(os.environ["RECORD"] + "/calls.jsonl", "a") as f:
    f.write(json.dumps({"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys}}) + "\\n")
if sys.argv[2] == "titan_foremoe.config.check" and os.environ["NODE_RANK"] == os.environ.get("FAIL_NODE"):
    print("config error: [training] steps: must be >= 1", file=sys.stderr)
    sys.exit(2)
if "--report-failure" in sys.argv:  # as launch.report_failure says it while the store host is not up yet
    print("launch: waiting up to 30 s for the rendezvous at ... to tell the other nodes that this one stops",
          file=sys.stderr)
    sys.exit(0)
print("stand-in", sys.argv[2], "on node", os.environ["NODE_RANK"])
""" % (ENV_KEYS,)


def _stand_ins(tmp: Path) -> Path:
    bin_dir = tmp / "bin"
    bin_dir.mkdir(parents=True)
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL), ("python", PYTHON)):
        path = bin_dir / name
        path.write_text(f"#!{sys.executable}\n{body}")
        path.chmod(0o755)
    return bin_dir


def _submit(tmp: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, list[dict]]:
    bin_dir = _stand_ins(tmp)
    (tmp / "record").mkdir()
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in ENV_KEYS}
    env = {**base, "PATH": f"{bin_dir}:{os.environ['PATH']}", "RECORD": str(tmp / "record"),
           "SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_ID": "4242",
           "SLURM_SUBMIT_DIR": str(ROOT), "SLURM_GPUS_ON_NODE": "8", "PYTHON": str(bin_dir / "python"),
           "LOG_DIR": str(tmp / "logs"), **env}
    r = subprocess.run(["bash", str(SBATCH), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    calls_file = tmp / "record" / "calls.jsonl"
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()] if calls_file.exists() else []
    return r, calls


def test_each_node_gets_its_run_train_and_torchrun_command(tmp_path):
    r, calls = _submit(tmp_path, "--training.steps=5", "--optimizer.lr=1e-3",
                       MAX_RESTARTS="3", CONFIG_FILE="./train_configs/debug_tiny_cpu.toml", SLURM_CPUS_ON_NODE="96")
    assert r.returncode == 0, r.stderr
    srun = json.loads((tmp_path / "record" / "srun.json").read_text())
    assert srun[:6] == ["--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--cpus-per-task=96", "--cpu-bind=none",
                        "--kill-on-bad-exit=1"]
    assert srun[-4:] == [str(ROOT / "run_train.sh"), str(tmp_path / "logs"), "--training.steps=5", "--optimizer.lr=1e-3"]
    overrides = ["--training.steps=5", "--optimizer.lr=1e-3"]
    resume = (f"PYTHON={tmp_path}/bin/python MAX_RESTARTS=3 CONFIG_FILE=./train_configs/debug_tiny_cpu.toml "
              f"LOG_DIR={tmp_path}/logs sbatch --nodes=2 scripts/slurm/train.sbatch --training.steps=5 "
              "--optimizer.lr=1e-3")
    for node in (0, 1):
        mine = [c for c in calls if c["env"]["NODE_RANK"] == str(node)]
        check, launch = mine  # pre-flight, torchrun (which decides the CUDA allocator setting itself)
        assert check["argv"] == ["-m", "titan_foremoe.config.check", CONFIG, "--world-size", "16",
                                 "--preflight", *overrides]
        assert check["env"]["LOCAL_WORLD_SIZE"] == "8"
        assert launch["argv"] == [
            "-m", "titan_foremoe.distributed.launch", "--nnodes=2", f"--node_rank={node}", "--nproc_per_node=8",
            "--max-restarts=3", "--rdzv_backend", "c10d", "--rdzv_endpoint=gpu-a17:29500",
            "--local-ranks-filter", "0", "--role", "rank", "--tee", "3",
            "-m", "titan_foremoe.train", "--job.config_file", CONFIG, *overrides]
        assert launch["env"] == {"NNODES": "2", "NODE_RANK": str(node), "NGPU": "8",
                                 "RDZV_ENDPOINT": "gpu-a17:29500", "MAX_RESTARTS": "3", "LOCAL_WORLD_SIZE": None,
                                 "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "TITAN_FOREMOE_RESUME_COMMAND": resume}
        log = (tmp_path / "logs" / f"node{node}.log").read_text()
        assert f"stand-in titan_foremoe.distributed.launch on node {node}" in log
    assert "2 nodes x 8 processes, rendezvous gpu-a17:29500, MAX_RESTARTS=3" in r.stdout


def test_a_failing_node_ends_the_job_with_its_line(tmp_path):
    r, calls = _submit(tmp_path, "--training.steps=0", FAIL_NODE="1", RDZV_PORT="29611")
    assert r.returncode == 2
    assert "train.sbatch: node1: config error: [training] steps: must be >= 1" in r.stderr.splitlines()
    # node 1 tells the nodes waiting at the rendezvous at once (run_train.sh's --report-failure)
    report = [c["argv"] for c in calls if "--report-failure" in c["argv"]]
    assert report == [["-m", "titan_foremoe.distributed.launch", "--report-failure", "gpu-a17:29611", "1", "30",
                       "config error: [training] steps: must be >= 1"]]


def test_outside_an_allocation_or_the_checkout_is_one_line(tmp_path):
    r, calls = _submit(tmp_path, SLURM_JOB_NODELIST="")
    assert (r.returncode, r.stderr.strip()) == (
        2, "train.sbatch: no SLURM_JOB_NODELIST: submit with sbatch (or run inside salloc)")
    r, calls = _submit(tmp_path / "b", TITAN_FOREMOE_DIR=str(tmp_path))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"train.sbatch: no run_train.sh in {tmp_path}: submit from the titan_foremoe checkout or set TITAN_FOREMOE_DIR")
    assert calls == []
