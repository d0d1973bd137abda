"""Verifiable tasks the debug model can learn on CPU.

A task samples (prompt, answer) pairs and scores a completion; the same task
feeds supervised warm-up (prompt + answer) and RL (prompt only, reward from
``reward``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


class Task(Protocol):
    name: str

    def sample(self, rng: random.Random) -> Example: ...

    def reward(self, example: Example, completion: str) -> float: ...

    def max_sequence_length(self) -> int: ...

    def max_answer_tokens(self) -> int: ...


def _positional_credit(answer: str, completion: str) -> float:
    """1.0 for an exact answer, else the fraction of answer positions right (x0.5)."""
    if completion == answer:
        return 1.0
    hits = sum(a == c for a, c in zip(answer, completion))
    return 0.5 * hits / max(len(answer), len(completion), 1)


@dataclass(frozen=True)
class SortDigits:
    """``sort:3141=`` -> ``1134``."""

    min_digits: int = 3
    max_digits: int = 6
    name: str = "sort_digits"

    def sample(self, rng: random.Random) -> Example:
        digits = "".join(rng.choice("0123456789") for _ in range(rng.randint(self.min_digits, self.max_digits)))
        return Example(prompt=f"sort:{digits}=", answer="".join(sorted(digits)))

    def reward(self, example: Example, completion: str) -> float:
        return _positional_credit(example.answer, completion)

    def max_sequence_length(self) -> int:
        return 1 + len("sort:=") + 2 * self.max_digits + 1  # bos ... eos

    def max_answer_tokens(self) -> int:
        return self.max_digits + 1  # answer + eos


@dataclass(frozen=True)
class AddDigits:
    """``add:123+45=`` -> ``168``."""

    min_digits: int = 1
    max_digits: int = 3
    name: str = "add_digits"

    def sample(self, rng: random.Random) -> Example:
        def number() -> int:
            n = rng.randint(self.min_digits, self.max_digits)
            return rng.randint(10 ** (n - 1) if n > 1 else 0, 10**n - 1)

        a, b = number(), number()
        return Example(prompt=f"add:{a}+{b}=", answer=str(a + b))

    def reward(self, example: Example, completion: str) -> float:
        return _positional_credit(example.answer, completion)

    def max_sequence_length(self) -> int:
        return 1 + len("add:+=") + 3 * self.max_digits + 1 + 1

    def max_answer_tokens(self) -> int:
        return self.max_digits + 2  # the sum may have one more digit, + eos


def build_task(data_cfg) -> Task:
    if data_cfg.task == "sort_digits":
        return SortDigits(data_cfg.min_digits, data_cfg.max_digits)
    if data_cfg.task == "add_digits":
        return AddDigits(data_cfg.min_digits, data_cfg.max_digits)
    raise ValueError(f"unknown task {data_cfg.task!r}")
