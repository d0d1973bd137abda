"""Plans from the stream (``train/ahead.py``) without an engine: at which point of step N the next step is
prepared, with which micro-step index its foresight logs, and the blocking fallback (the live run, equal losses
with and without ``plan_from_stream``, is in test_vllm_fleet.py)."""

from __future__ import annotations

import pytest

from titan_foremoe.config.job_config import JobConfig
from titan_foremoe.train import ahead


class _Trainer:
    """What ``StreamAhead`` reads of the trainer: the source's poll answers ``None`` until ``ready_at``."""

    def __init__(self, stream: bool, ready_at: int, k: int = 2, steps: int = 5):
        self.cfg = JobConfig()
        self.cfg.rl.max_staleness, self.cfg.rl.plan_from_stream = k, stream
        self.steps, self.micro_steps_done, self.polls, self.point = steps, 100, [], 0
        self.watchdog = type("W", (), {"phase": lambda self, what: None})()
        trainer = self

        class Source:
            def poll(self, step, wait=True):
                trainer.polls.append((trainer.point, step, wait))
                return "rows" if wait or trainer.point >= ready_at else None
        self.source = Source()

    def job_steps(self):
        return self.steps


@pytest.fixture
def prepared(monkeypatch):
    calls = []
    monkeypatch.setattr(ahead, "prepare_step", lambda tr, step, batch, ahead=False, first_micro=None:
                        calls.append((step, batch, ahead, first_micro)) or ("prepared", step))
    return calls


def _run(tr: _Trainer, step: int, updates: int = 3, micro: int = 4):
    s = ahead.StreamAhead(tr, step, updates, micro)
    for u in range(updates):  # as rl_step: point 0 after the recompute, u after mini-batch u
        tr.point = u
        s.point(u)
        tr.micro_steps_done += micro  # the mini-batch's micro-steps log
    tr.point = updates
    return s, s.finish()


@pytest.mark.parametrize("ready_at", [0, 1, 2, 3])
def test_prepared_at_the_first_point_its_rows_are_complete(prepared, ready_at):
    tr = _Trainer(stream=True, ready_at=ready_at)
    s, out = _run(tr, 1)
    assert out == ("prepared", 2) and s.metrics()["foresight/prepared_at"] == float(ready_at)
    assert [p for p, _, _ in tr.polls] == list(range(ready_at + 1))  # no poll once prepared
    assert [w for _, _, w in tr.polls] == [False] * min(ready_at + 1, 3) + [True] * (ready_at == 3)
    assert prepared == [(2, "rows", True, 100 + 3 * 4)]  # logs at step 2's first micro-step, whatever the point


def test_without_plan_from_stream_only_the_blocking_poll_after_the_update(prepared):
    tr = _Trainer(stream=False, ready_at=0)
    s, out = _run(tr, 1)
    assert tr.polls == [(3, 2, True)] and s.metrics()["foresight/prepared_at"] == 3.0
    assert prepared == [(2, "rows", True, 112)]


def test_nothing_ahead_at_the_last_step_or_synchronously(prepared):
    for tr, step, metrics in ((_Trainer(stream=True, ready_at=0), 4, {"foresight/prepared_at": -1.0,
                                                                      "time/prepare_next_s": 0.0}),
                              (_Trainer(stream=True, ready_at=0, k=0), 1, {})):
        s, out = _run(tr, step)
        assert out is None and tr.polls == [] and s.metrics() == metrics and prepared == []
