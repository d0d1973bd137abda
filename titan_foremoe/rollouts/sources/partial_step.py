"""A synchronous step's generation with partial rollouts (``[rl] rollout_token_budget``; ``rollouts/partial.py``
for the rules and their cost): the carried unfinished responses continue (prompt + partial re-sent, one sample
each) next to the step's new prompts, over the fleet, until this rank's ``StopRule`` is met, when the fleet
client aborts what still runs (``fleet/budgeted.py``); every answer extends its response with the tokens,
behaviour log-probs, routes and the serving weights' version; the finished groups train, the others are
carried (or dropped: ``partial_max_staleness``), and the carry goes into checkpoints (``save_carry`` /
``load_carry``).

Called by ``VLLMSource.next_batch`` (the synchronous path only: ``[rl] max_staleness = 0``), after the weight
sync and probe; collective like ``VLLMSource._generate`` (the deal's all-gather, the failure agreement).
"""

from __future__ import annotations

import os
import pickle
import time

import torch

from ..engines.vllm_api import Completion
from ..fleet.budgeted import arm
from ..partial import Carry, StopRule, continuation, extend, split, step_metrics

__all__ = ["generate_partial", "load_carry", "save_carry"]


def _seed(cfg, step: int, dp_rank: int, uid: int, j: int) -> int:
    return (cfg.job.seed * 1_000_003 + step * 65_537 + dp_rank * 4099 + uid * 131 + j) % 2**31


def requests_of(carry: Carry, groups, step: int, dp_rank: int, cfg) -> tuple[list[dict], list[list]]:
    """One request per new group (its ``samples_per_prompt`` samples, seeded as the synchronous path seeds
    them) and one per unfinished sample of a carried group (its prompt + partial response); each request's
    target responses."""
    rl = cfg.rl
    reqs, targets = [], []
    for g in groups:
        rid = f"tf-r{dp_rank}-s{step}-g{g.uid}"
        fresh = all(not s.token_ids and s.finish_reason is None for s in g.samples)
        if fresh:
            reqs.append(dict(prompt_ids=g.prompt_ids, n=len(g.samples), max_tokens=rl.max_new_tokens,
                             temperature=rl.temperature, top_p=rl.top_p, seed=_seed(cfg, step, dp_rank, g.uid, 0),
                             group=g.uid, request_id=rid))
            targets.append(list(g.samples))
            continue
        for j, s in enumerate(g.samples):
            if s.finished:
                continue
            prompt, left = continuation(s, rl.max_new_tokens)
            reqs.append(dict(prompt_ids=prompt, n=1, max_tokens=left, temperature=rl.temperature, top_p=rl.top_p,
                             seed=_seed(cfg, step, dp_rank, g.uid, j), group=g.uid, request_id=f"{rid}-s{j}"))
            targets.append([s])
    return reqs, targets


def generate_partial(src, f) -> None:
    """Collective: ``f`` (an ``InFlight`` of this step's new prompts) generated with the carry, its finished
    groups built as ``f.batch`` (``src._build``), ``f.extra`` with the partial metrics."""
    rl, step = src.cfg.rl, f.step
    carry: Carry = src.carry
    t0 = time.perf_counter()
    new = [carry.new_group(ex, p, step, rl.samples_per_prompt) for ex, p in zip(f.examples, f.prompts)]
    groups = carry.groups + new
    reqs, targets = requests_of(carry, groups, step, src.dp_rank, src.cfg)
    rule = StopRule(rl.rollout_token_budget, groups, started_at=t0, chunk=rl.rollout_chunk_tokens)
    arm(rule)
    fleet = src._fleet()
    dealt = fleet.deal(reqs, src.expected_response)
    dealt.rule = rule
    fleet.send(dealt)
    answers = src._finish(dealt)
    for ts, cs in zip(targets, answers):
        for s, c in zip(ts, cs):
            extend(s, c.token_ids, c.logprobs, c.routes_RXK if c.token_ids else None, c.finish_reason, f.version)
            if not s.finished and len(s.token_ids) >= rl.max_new_tokens:
                s.finish_reason = "length"
    train, carried, dropped = split(groups, step, rl.partial_max_staleness)
    carry.groups = carried
    carry.dropped_stale += sum(len(g.samples) for g in dropped)
    if not train:  # only after a resume with a smaller partial_max_staleness: every finished group too old
        raise RuntimeError(f"step {step}: no finished group to train on data-parallel rank {src.dp_rank} (the "
                           f"{len(dropped)} finished are older than [rl] partial_max_staleness = "
                           f"{rl.partial_max_staleness})")
    f.examples, f.prompts = [g.example for g in train], [g.prompt_ids for g in train]
    f.groups = [[Completion(g.prompt_ids, s.token_ids, s.logprobs, s.routes_RXK, s.finish_reason) for s in g.samples]
                for g in train]
    f.token_versions = [list(s.versions) for g in train for s in g.samples]
    f.generate_s = f.wait_s = time.perf_counter() - t0
    src._build(f)
    W = f.batch.rollout.tokens_BT.shape[1]
    versions = torch.full((len(f.token_versions), W), -1, dtype=torch.int64)
    for b, (g_s, vs) in enumerate(zip([s for g in train for s in g.samples], f.token_versions)):
        p = len(g_s.prompt_ids)
        versions[b, p: p + len(vs)] = torch.tensor(vs, dtype=torch.int64)
    f.batch.versions_BT = versions
    f.extra.update(step_metrics(train, carried, dropped, step))
    f.extra.update({"rollout/dropped_stale_total": float(carry.dropped_stale),
                    "rollout/engine_idle_fraction": rule.idle_fraction(src.eng.concurrency,
                                                                       int(fleet.alive_K.sum()))})


def _path(folder: str, dp_rank: int) -> str:
    return os.path.join(folder, f"partial_rank{dp_rank:04d}.pkl")


def save_carry(carry: Carry, folder: str, dp_rank: int) -> None:
    """This rank's unfinished responses into a checkpoint's ``folder`` (atomically)."""
    os.makedirs(folder, exist_ok=True)
    path = _path(folder, dp_rank)
    with open(path + ".tmp", "wb") as out:
        pickle.dump(carry.state_dict(), out)
    os.replace(path + ".tmp", path)


def load_carry(carry: Carry, folder: str, dp_rank: int) -> bool:
    """The unfinished responses a checkpoint saved for this rank (False: none saved, the carry stays empty)."""
    path = _path(folder, dp_rank)
    if not os.path.isfile(path):
        return False
    with open(path, "rb") as src:
        carry.load_state_dict(pickle.load(src))
    return True
