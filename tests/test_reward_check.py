"""Issue 31: every reward is a finite number, or its function, row and value are named (single process)."""

from __future__ import annotations

import math

import numpy as np

from titan_foremoe.data.prompts import PromptExample
from titan_foremoe.data.tasks import Example
from titan_foremoe.rl.reward_check import CheckedReward
from titan_foremoe.rl.rewards import math_reward
from titan_foremoe.rollouts.sources.base import score


def test_values_that_are_not_finite_numbers_are_scored_zero_and_named():
    outputs = iter([1, 0.5, np.float32(0.25), True, "1.0", None, math.nan, -math.inf, [1.0]])
    checked = CheckedReward(lambda task, ex, c: next(outputs), "mine:reward")
    row = PromptExample(prompt="Tom has 3 pens.", answer="3", row=7)
    got = [checked(None, row, "") for _ in range(9)]
    assert got == [1.0, 0.5, 0.25, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0] and all(type(v) is float for v in got)
    count, first = checked.take()
    assert count == 5
    assert first == "[rl] reward_fn 'mine:reward' returned '1.0' (a str, not a number) for [data] path row 7 (answer '3')"
    assert checked.take() == (0, None)  # counted per step
    checked = CheckedReward(lambda task, ex, c: math.nan, "task")
    checked(None, Example(prompt="3 1 2", answer="123"), "")
    assert checked.take()[1] == "[rl] reward_fn 'task' returned nan (not finite) for prompt '3 1 2' (answer '123')"


def test_checked_math_reward_still_gives_exactness():
    checked = CheckedReward(math_reward, "math")
    rewards, exact = score(checked, None, [Example(prompt="", answer="14")] * 2, ["\\boxed{14}", "7"],
                           math_exact=True)
    assert rewards.tolist() == exact.tolist() == [1.0, 0.0]
