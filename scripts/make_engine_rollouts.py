"""Write the debug model's own rollouts as an engine's output file (vLLM, SGLang, verl or slime).

Stands in for a real vLLM/SGLang rollout job in the README's worked example: the
debug MoE (one process, the config's seed) samples the config's task prompts the
way the embedded rollout does, ``steps`` x ``global_batch_size x
updates_per_rollout`` sequences, and the file is written in ``--format``'s wire
layout with the answers (no rewards: the trainer computes them).

    python scripts/make_engine_rollouts.py --format sglang --steps 4 --out outputs/engine/sglang.jsonl

With a config whose ``[model] hf_assets_path`` is set, transformers' Qwen3-MoE is the
engine instead (``samples_from_transformers``): the ``[data] path`` prompts in file
order, chat-templated with ``system_prompt``, sampled at ``[rl] temperature``.
"""

from __future__ import annotations

import argparse
import os
import sys
import random

import torch

from titan_foremoe.config import load_config
from titan_foremoe.config.validate import model_args, validate
from titan_foremoe.data.tasks import build_task
from titan_foremoe.data.tokenizer import CharTokenizer
from titan_foremoe.distributed.parallelize import build_model
from titan_foremoe.rollouts.generate import GenerationConfig, generate
from titan_foremoe.rollouts import FORMATS
from titan_foremoe.rollouts.export import samples_from_rollout, samples_from_transformers, write_engine_file


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="train_configs/debug_tiny_rl.toml")
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--world-size", type=int, default=4, help="the training job's world size (rows per step)")
    ap.add_argument("--out", required=True, help="a .jsonl or .parquet file")
    ap.add_argument("--no-route-tokens", type=float, default=0.0,
                    help="fraction of routed tokens sent without routes (-1 at every layer), as an engine does for "
                         "tokens it did not capture; seeded by the config's seed")
    args, overrides = ap.parse_known_args()
    cfg = load_config(args.config, overrides)
    resolved = validate(cfg, args.world_size)
    rl, tok = cfg.rl, CharTokenizer()
    if cfg.model.hf_assets_path:
        from titan_foremoe.data.prompts import read_rows

        d = cfg.data
        n = args.steps * resolved.rollout_sequences // rl.samples_per_prompt
        rows = read_rows(d.path)[:n]
        samples = samples_from_transformers(
            cfg.model.hf_assets_path, [(str(r[d.prompt_key]), str(r[d.answer_key])) for r in rows],
            system_prompt=d.system_prompt, samples_per_prompt=rl.samples_per_prompt,
            max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, seed=cfg.job.seed)
        return _write(args, samples, rl, resolved)
    torch.manual_seed(cfg.job.seed)
    model = build_model(cfg, model_args(cfg, vocab_size=tok.vocab_size), None, torch.device("cpu"))
    task = build_task(cfg.data)
    gen = GenerationConfig(max_new_tokens=rl.max_new_tokens, temperature=rl.temperature, top_p=rl.top_p)
    rng = random.Random(f"{cfg.job.seed}/engine")
    samples = []
    for step in range(args.steps):
        examples = [task.sample(rng) for _ in range(resolved.rollout_sequences // rl.samples_per_prompt)]
        examples = [ex for ex in examples for _ in range(rl.samples_per_prompt)]
        prompts = [[tok.bos_id, *tok.encode(ex.prompt)] for ex in examples]
        rollout = generate(model, prompts, gen, eos_id=tok.eos_id, pad_id=tok.pad_id, num_experts=resolved.num_experts,
                           generator=torch.Generator().manual_seed(step))
        groups = [f"step{step}-prompt{i // rl.samples_per_prompt}" for i in range(len(examples))]
        samples += samples_from_rollout(rollout, answers=[ex.answer for ex in examples], groups=groups)
    _write(args, samples, rl, resolved)


def _write(args, samples, rl, resolved) -> None:
    if args.no_route_tokens > 0:
        import numpy as np

        rng = np.random.default_rng(0)
        holes = 0
        for s in samples:
            hit = rng.random(len(s.routes_RXK)) < args.no_route_tokens
            s.routes_RXK = np.where(hit[:, None, None], -1, s.routes_RXK)
            holes += int(hit.sum())
        print(f"{holes} tokens sent without routes (-1)")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    write_engine_file(args.format, samples, args.out, samples_per_prompt=rl.samples_per_prompt)
    print(f"wrote {len(samples)} {args.format} rollouts ({args.steps} steps x {resolved.rollout_sequences}) to {args.out}")


if __name__ == "__main__":
    from titan_foremoe.config.loader import one_line_errors

    sys.exit(one_line_errors(main))
