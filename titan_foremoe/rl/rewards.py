"""Reward functions: the task's own, exact match, or any ``module:function``.

A reward function takes ``(task, example, completion_text)`` and returns a float.
``[rl] format_reward`` adds a bonus to completions that pass ``format_ok``.
"""

from __future__ import annotations

import importlib
import re
import threading
from collections.abc import Callable

from ..data.tasks import Example, Task

RewardFn = Callable[[Task, Example, str], float]


def task_reward(task: Task, example: Example, completion: str) -> float:
    return task.reward(example, completion)


def exact_match(task: Task, example: Example, completion: str) -> float:
    return 1.0 if completion == example.answer else 0.0


def math_reward(task: Task, example: Example, completion: str) -> float:
    """1.0 when math-verify finds the completion's final answer (``\\boxed{}`` first, else the last
    expression) equal to the reference answer, else 0.0."""
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    main = threading.current_thread() is threading.main_thread()
    parse_kw, verify_kw = ({}, {}) if main else ({"parsing_timeout": None}, {"timeout_seconds": None})
    gold = parse(example.answer, **parse_kw)
    pred = parse(completion, **parse_kw)
    return 1.0 if gold and pred and verify(gold, pred, **verify_kw) else 0.0


_BOXED = re.compile(r"\\boxed\{[^{}]+\}")


def format_ok(completion: str) -> bool:
    """The completion states its final answer in one non-empty ``\\boxed{}``."""
    return len(_BOXED.findall(completion)) == 1


BUILTIN: dict[str, RewardFn] = {"task": task_reward, "exact_match": exact_match, "math": math_reward}


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
