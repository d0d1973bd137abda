"""The abort at exit (``distributed/process_exit.py``): a daemon thread inside a ``TCPStore`` call when the
interpreter finalizes aborts the process (CPython 3.11-3.13 + pybind11: "terminate called without an active
exception", exit -6), which CI saw as a finished job's rank 1 and a stopped launcher's 143 both turned into -6.
The launcher's and the workers' entry points leave with their own code however their daemon threads stand."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A store, and a daemon thread blocked in a get on it (GIL released inside pybind11), as torchrun's rendezvous
# keep-alive or a rank's heartbeat can be at exit.
_BLOCKED = textwrap.dedent("""
    import datetime, sys, threading, time
    from torch.distributed import TCPStore
    server = TCPStore("127.0.0.1", 0, is_master=True, timeout=datetime.timedelta(seconds=60))
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=datetime.timedelta(seconds=60))
    threading.Thread(target=lambda: client.get("never set"), daemon=True).start()
    time.sleep(0.3)
""")


def _run(body: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", _BLOCKED + textwrap.dedent(body)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(not (3, 11) <= sys.version_info[:2] <= (3, 13), reason="CPython 3.14 hangs such a thread instead")
def test_a_daemon_thread_in_a_store_call_aborts_a_plain_exit():
    """The hazard itself, on Python's own exit: what the entry points avoid."""
    out = _run("sys.exit(3)")
    assert out.returncode == -6, (out.returncode, out.stderr[-2000:])
    assert "terminate called without an active exception" in out.stderr


def test_run_and_exit_keeps_the_code_and_the_output():
    out = _run("""
        from titan_foremoe.distributed.process_exit import run_and_exit
        import logging
        logging.basicConfig(level=logging.INFO, stream=sys.stderr)
        def main(code):
            print("kept on stdout", end="")  # no newline: only a flush writes it
            logging.getLogger("x").info("kept in the log")
            return code
        run_and_exit(main, 3)
    """)
    assert out.returncode == 3, (out.returncode, out.stderr[-2000:])
    assert out.stdout == "kept on stdout" and "kept in the log" in out.stderr


def test_run_and_exit_reports_an_uncaught_exception_as_python_does():
    out = _run("""
        from titan_foremoe.distributed.process_exit import run_and_exit
        def main():
            raise ValueError("the cause")
        run_and_exit(main)
    """)
    assert out.returncode == 1, (out.returncode, out.stderr[-2000:])
    assert "Traceback" in out.stderr and "ValueError: the cause" in out.stderr


def test_the_launchers_entry_point_exits_with_its_code():
    """``python -m titan_foremoe.distributed.launch`` (here its ``--report-failure`` form, on the blocked store)."""
    out = _run("""
        import runpy
        sys.argv = ["launch", "--report-failure", f"127.0.0.1:{server.port}", "1", "5", "a line"]
        runpy.run_module("titan_foremoe.distributed.launch", run_name="__main__", alter_sys=True)
    """)
    assert out.returncode == 0, (out.returncode, out.stderr[-2000:])


def test_the_workers_entry_point_exits_with_its_code(tmp_path):
    """``python -m titan_foremoe.train`` with a config file that is not there: its one line and exit 2."""
    out = _run(f"""
        import runpy
        sys.argv = ["train", "--job.config_file", {str(tmp_path / "missing.toml")!r}]
        runpy.run_module("titan_foremoe.train", run_name="__main__", alter_sys=True)
    """)
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "config error" in out.stderr


def test_without_a_daemon_thread_the_exit_is_pythons_own():
    """``--help`` run in a caller's interpreter (tests/test_docs.py runs every documented module so): SystemExit
    reaches the caller, which goes on."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1"}
    body = textwrap.dedent("""
        import runpy, sys
        sys.argv = ["launch", "--help"]
        try:
            runpy.run_module("titan_foremoe.distributed.launch", run_name="__main__", alter_sys=True)
        except SystemExit as e:
            print("caller goes on after exit", e.code)
    """)
    out = subprocess.run([sys.executable, "-c", body], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "caller goes on after exit 0" in out.stdout, (out.returncode, out.stderr[-2000:])
