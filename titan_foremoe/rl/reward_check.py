"""Every reward checked: a finite real number, or the job says which function, row and value (issue 31).

A reward function returning NaN used to stop the job as ``non-finite loss = nan`` without naming the reward;
``None`` ended in a TypeError naming no function; the string ``"1.0"`` was used as 1.0. ``CheckedReward`` wraps
the configured function: a value that is not a finite real number (bool, int, float, numpy scalar) is scored 0
and remembered (the first one in words, and a count). It does not raise: rewards are scored on every rank for its
own rows, and a rank that stopped alone would leave the others waiting in a collective. The trainer agrees on the
count across ranks once per step (``RLTrainer._check_rewards``) and then stops on every rank naming the first
bad value (``[rl] bad_reward = "stop"``), or reports how many were counted as 0 (``"zero"``).

Cost: one ``isinstance`` and ``isfinite`` per completion scored; the trainer's 8-byte all-reduce per step.
"""

from __future__ import annotations

import math
import numbers


class RewardError(RuntimeError):
    """A reward function returned something that is not a finite number (``[rl] bad_reward = "stop"``)."""


def _row(example) -> str:
    row = getattr(example, "row", -1)
    where = f"[data] path row {row}" if isinstance(row, int) and row >= 0 else f"prompt {example.prompt[-60:]!r}"
    return f"{where} (answer {str(example.answer)[:40]!r})"


_TYPE_FIX = "the reward function must return float(reward)"


def reward_problem(value) -> str | None:
    """Why ``value`` is not a usable reward, or None. A number in a box (a 0-dim tensor or array, a one-element
    list) is a bug of the function, not a bad value: the fix is named (``bad_reward = "zero"`` would score every
    reward 0)."""
    if not isinstance(value, numbers.Real):
        shape = getattr(value, "shape", None)
        if (shape is not None and len(shape) == 0) or (isinstance(value, (list, tuple)) and len(value) == 1):
            kind = f"a 0-dim {type(value).__module__.split('.')[0]}.{type(value).__name__}" if shape is not None \
                else f"a one-element {type(value).__name__}"
            return f"{kind}, not a number: {_TYPE_FIX} (e.g. reward.item())"
        return f"a {type(value).__name__}, not a number"
    if not math.isfinite(float(value)):
        return "not finite"
    return None


class CheckedReward:
    """``fn`` with its values checked; ``bad`` counts the values scored as 0, ``first`` describes the first."""

    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name
        self.bad, self.first = 0, None

    def __call__(self, task, example, completion: str) -> float:
        value = self.fn(task, example, completion)
        problem = reward_problem(value)
        if problem is None:
            return float(value)
        self.bad += 1
        if self.first is None:
            self.first = f"[rl] reward_fn {self.name!r} returned {value!r} ({problem}) for {_row(example)}"
        return 0.0

    def take(self) -> tuple[int, str | None]:
        """The count and first description since the last call (one step's)."""
        out = (self.bad, self.first)
        self.bad, self.first = 0, None
        return out


def stop_hint(first: str) -> str:
    """What to do about the first bad reward of a step that stopped the job."""
    if _TYPE_FIX in first:
        return "fix the reward function: [rl] bad_reward = 'zero' would score every reward 0"
    return "[rl] bad_reward = 'zero' scores such rewards 0 and goes on"
