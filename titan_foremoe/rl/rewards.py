"""Reward functions: the task's own, exact match, or any ``module:function``.

A reward function takes ``(task, example, completion_text)`` and returns a float.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from ..data.tasks import Example, Task

RewardFn = Callable[[Task, Example, str], float]


def task_reward(task: Task, example: Example, completion: str) -> float:
    return task.reward(example, completion)


def exact_match(task: Task, example: Example, completion: str) -> float:
    return 1.0 if completion == example.answer else 0.0


BUILTIN: dict[str, RewardFn] = {"task": task_reward, "exact_match": exact_match}


def resolve_reward(name: str) -> RewardFn:
    """A builtin name or an importable ``package.module:function``."""
    if name in BUILTIN:
        return BUILTIN[name]
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward_fn {name!r}: expected one of {sorted(BUILTIN)} or 'module:function'")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward_fn {name!r}: cannot import ({e})") from None
    if not callable(fn):
        raise ValueError(f"reward_fn {name!r} is not callable")
    return fn
