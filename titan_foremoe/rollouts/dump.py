"""Rollout dumps: ``dump_folder/rollouts/step_XXXXX.jsonl``, one line per sequence (what verl's dump gives users).

Each line: ``prompt_ids``, ``completion_ids``, ``prompt``, ``completion``,
``reward``, ``answer`` (plus ``step`` and ``dp_rank``). Rows are gathered to
rank 0 as Python objects once per step: 1024 sequences of 2k tokens are about
20 MB of JSON, small next to the rollout that made them.
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from .generate import Rollout


def dump_rows(step: int, dp_rank: int, rollout: Rollout, examples, completions: list[str], rewards) -> list[dict]:
    rows = []
    for b, (ex, text) in enumerate(zip(examples, completions)):
        p = int(rollout.prompt_lens_B[b])
        rows.append({
            "step": step, "dp_rank": dp_rank,
            "prompt_ids": rollout.tokens_BT[b, :p].tolist(), "completion_ids": rollout.completion(b),
            "prompt": ex.prompt, "completion": text, "reward": float(rewards[b]), "answer": ex.answer,
        })
    return rows


def write_dump(folder: str, step: int, rows: list[dict]) -> None:
    """Gather every rank's rows to rank 0 and write each data-parallel rank's rows once (ranks that share a
    ``dp_rank`` hold the same sequences)."""
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(rows, gathered, dst=0)
    if dist.get_rank() != 0:
        return
    os.makedirs(folder, exist_ok=True)
    seen = set()
    with open(os.path.join(folder, f"step_{step:05d}.jsonl"), "w") as f:
        for rank_rows in gathered:
            if not rank_rows or rank_rows[0]["dp_rank"] in seen:
                continue
            seen.add(rank_rows[0]["dp_rank"])
            for row in rank_rows:
                f.write(json.dumps(row) + "\n")
