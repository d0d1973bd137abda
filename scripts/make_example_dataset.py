"""Write the example prompt dataset: arithmetic word problems with their answers (JSONL).

    python scripts/make_example_dataset.py --out examples/arithmetic_word_problems.jsonl --n 400 --seed 0

Each line is ``{"prompt": ..., "answer": ...}``; the answer is the final number
(what the ``math`` reward compares against with math-verify).
"""

from __future__ import annotations

import argparse
import json
import random

NAMES = ["Tom", "Ann", "Sam", "Lea", "Max", "Mia", "Ben", "Eva"]
ITEMS = ["apples", "pens", "books", "cards", "coins", "shells", "stamps", "eggs"]


def problem(rng: random.Random) -> dict:
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    kind = rng.choice(["add", "sub", "mul"])
    if kind == "add":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        text, answer = f"{name} has {a} {item}. {name} gets {b} more {item}. How many {item} does {name} have now?", a + b
    elif kind == "sub":
        a = rng.randint(2, 9)
        b = rng.randint(1, a)
        text, answer = f"{name} has {a} {item}. {name} gives away {b} {item}. How many {item} are left?", a - b
    else:
        a, b = rng.randint(1, 5), rng.randint(1, 4)
        text, answer = f"{name} has {a} bags with {b} {item} in each bag. How many {item} does {name} have?", a * b
    return {"prompt": text, "answer": str(answer)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with open(args.out, "w") as f:
        for _ in range(args.n):
            f.write(json.dumps(problem(rng)) + "\n")


if __name__ == "__main__":
    main()
