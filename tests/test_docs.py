"""The documentation stays true to the code: the generated configuration reference is current, every key in it
has a meaning, and every command the README and docs/ show names a script or module whose ``--help`` runs and
config keys that exist."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

from titan_foremoe.config import reference
from titan_foremoe.config.job_config import JobConfig

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SCRIPT = re.compile(r"(?:python3?|torchrun [^\n]*?) ((?:scripts|benchmarks)/[\w/]+\.py)")
PATH = re.compile(r"\b((?:scripts|benchmarks)/[\w/]+\.\w+)")  # every file the docs name in those folders
MODULE = re.compile(r"python3? -m (titan_foremoe[\w.]*)")
OVERRIDE = re.compile(r"(?<![\w-])--([a-z_]+)\.([a-z_]+)\b")
CLI_ONLY = {("job", "config_file"), ("section", "key")}  # the loader's own flag; the placeholder in prose


def _doc_text() -> str:
    return "\n".join(p.read_text() for p in DOCS)


def test_configuration_reference_is_current():
    assert reference.main(["--check"]) == 0, "docs/configuration.md is stale: python -m titan_foremoe.config.reference"


def test_every_config_key_has_a_meaning():
    missing = []
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory().__class__
        docs = reference._field_docs(cls)
        missing += [f"[{section.name}] {f.name}" for f in dataclasses.fields(cls) if not docs.get(f.name)]
    assert not missing, f"config keys without a doc string in job_config.py: {missing}"


def test_documented_overrides_exist():
    sections = {s.name: {f.name for f in dataclasses.fields(s.default_factory().__class__)}
                for s in dataclasses.fields(JobConfig)}
    named = set(OVERRIDE.findall(_doc_text()))
    assert named, "no --section.key override found in the docs: the pattern is broken"
    unknown = sorted(f"--{s}.{k}" for s, k in named if (s, k) not in CLI_ONLY and k not in sections.get(s, ()))
    assert not unknown, f"documented config overrides that do not exist: {unknown}"


def test_documented_commands_run_help():
    text = _doc_text()
    scripts = sorted(set(SCRIPT.findall(text)))
    modules = sorted(set(MODULE.findall(text)))
    assert scripts and modules, "no documented command found: the patterns are broken"
    absent = sorted(p for p in set(scripts) | set(PATH.findall(text)) if not (ROOT / p).is_file())
    assert not absent, f"documented scripts that do not exist: {absent}"
    # One interpreter for all: each target runs as __main__ with --help and must exit 0 printing its usage.
    probe = r"""
import contextlib, io, json, runpy, sys
out = {}
for kind, target in json.loads(sys.argv[1]):
    sys.argv = [target, "--help"]
    buf = io.StringIO()
    code = None
    try:
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            if kind == "script":
                runpy.run_path(target, run_name="__main__")
            else:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code or 0
    except BaseException as e:
        code = f"{type(e).__name__}: {e}"
    out[target] = [code, "usage" in buf.getvalue().lower()]
print(json.dumps(out))
"""
    targets = [["script", s] for s in scripts] + [["module", m] for m in modules]
    res = subprocess.run([sys.executable, "-c", probe, json.dumps(targets)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    bad = {t: r for t, r in results.items() if r != [0, True]}
    assert not bad, f"documented commands whose --help does not run (exit code, printed usage): {bad}"
