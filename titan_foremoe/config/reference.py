"""The configuration reference, generated from the dataclasses of ``job_config.py``.

    python -m titan_foremoe.config.reference            # writes docs/configuration.md
    python -m titan_foremoe.config.reference --check    # exit 1 if that file is stale

Each key's type and default come from the dataclass itself; its meaning from the field's own doc string (the
string literal under the field, or the ``#`` comment lines just above it), read from the source with ``ast``,
so the reference cannot drift from the code: ``tests/test_docs.py`` runs ``--check``.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import re
import sys
from pathlib import Path

from . import job_config
from .job_config import JobConfig

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def _field_docs(cls: type) -> dict[str, str]:
    """``{field: doc}`` from the class source: the string under a field, else the comment lines above it."""
    src = inspect.getsource(cls)
    lines = src.splitlines()
    body = ast.parse(src).body[0].body
    docs: dict[str, str] = {}
    for i, node in enumerate(body):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        nxt = body[i + 1] if i + 1 < len(body) else None
        if isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
            docs[node.target.id] = inspect.cleandoc(nxt.value.value)
            continue
        comments, j = [], node.lineno - 2  # lines are 1-based; the line above the field
        while j >= 0 and lines[j].strip().startswith("#"):
            comments.insert(0, lines[j].strip().lstrip("#").strip())
            j -= 1
        if comments:
            docs[node.target.id] = " ".join(comments)
    return docs


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        value = f.default
    elif f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
    else:
        return "(required)"
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None:
        return "unset"
    return f"`{value!r}`"


def _type(cls: type, name: str) -> str:
    ann = str(cls.__annotations__[name])  # a string: the module uses ``from __future__ import annotations``
    ann = re.sub(r"Literal\[('[^',]*')\]", r"\1", ann)  # one choice: the value itself ('auto' or int)
    return ann.replace("Literal[", "one of [").replace("|", "or")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def render() -> str:
    out = [
        "# Configuration reference",
        "",
        "Generated from `titan_foremoe/config/job_config.py` by `python -m titan_foremoe.config.reference`; do not",
        "edit by hand (`tests/test_docs.py` fails when this file is stale). A TOML file in `train_configs/` sets",
        "`[section] key = value`; on the command line `--section.key=value` overrides it (torchtitan's",
        "convention). Unknown sections or keys, wrong types and inconsistent values are refused before any worker",
        "starts (`python -m titan_foremoe.config.check`, exit 2, one line naming the key).",
        "",
    ]
    for section in dataclasses.fields(JobConfig):
        cls = section.default_factory().__class__
        out += [f"## `[{section.name}]`", ""]
        if cls.__doc__ and not cls.__doc__.startswith(cls.__name__ + "("):
            out += [inspect.cleandoc(cls.__doc__), ""]
        docs = _field_docs(cls)
        out += ["| key | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            out.append(f"| `{f.name}` | {_cell(_type(cls, f.name))} | {_default(f)} | {_cell(docs.get(f.name, ''))} |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="where to write the reference")
    ap.add_argument("--check", action="store_true", help="exit 1 if --out differs from the generated text")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run python -m titan_foremoe.config.reference", file=sys.stderr)
            return 1
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


assert job_config  # the module whose source is read
if __name__ == "__main__":
    sys.exit(main())
