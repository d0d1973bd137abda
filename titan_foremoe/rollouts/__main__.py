"""``python -m titan_foremoe.rollouts import --format vllm|sglang|verl|slime IN... --out DIR``."""

from __future__ import annotations

import argparse
import json
import sys

from .formats import FORMATS
from .importer import import_rollouts
from .sample import ModelSpec, RolloutError


def _spec(args) -> ModelSpec:
    if args.model_config:
        from ..config import load_config
        from ..config.validate import model_args

        cfg = load_config(args.model_config, args.overrides)
        m = model_args(cfg)  # the model's own vocabulary: token ids are checked against it, never decoded here
        spec = ModelSpec(m.n_layers, m.top_k, m.num_experts, m.vocab_size)
    elif args.hf_assets_path:
        from ..models.hf import model_args_from_hf

        m = model_args_from_hf(args.hf_assets_path)  # config.json: the trainer reads the same (config.validate)
        spec = ModelSpec(m.n_layers, m.top_k, m.num_experts, m.vocab_size)
    else:
        spec = ModelSpec(0, 0, 0, None)
    spec = ModelSpec(
        args.num_layers or spec.num_layers, args.top_k or spec.top_k, args.num_experts or spec.num_experts,
        args.vocab_size or spec.vocab_size,
    )
    if not (spec.num_layers and spec.top_k and spec.num_experts):
        raise SystemExit("rollouts import: give --model-config (a training TOML), --hf-assets-path (an HF folder) "
                         "or --num-layers, --top-k and --num-experts")
    return spec


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m titan_foremoe.rollouts")
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import", help="convert engine outputs (JSONL / Parquet) into a rollout directory")
    imp.add_argument("--format", required=True, choices=FORMATS)
    imp.add_argument("inputs", nargs="+", metavar="IN")
    imp.add_argument("--out", required=True, help="rollout directory to create")
    imp.add_argument("--model-config", help="training TOML whose [model] the routes must fit")
    imp.add_argument("--hf-assets-path", help="Hugging Face folder whose config.json the routes must fit")
    imp.add_argument("--num-layers", type=int)
    imp.add_argument("--top-k", type=int)
    imp.add_argument("--num-experts", type=int)
    imp.add_argument("--vocab-size", type=int)
    imp.add_argument("--skip-bad", action="store_true", help="skip (and count) bad samples' groups instead of failing")
    imp.add_argument("--rows-per-shard", type=int, default=4096)
    imp.add_argument("--expert-map", help="JSON: the logical expert of every physical slot of an engine-side EPLB, "
                     "one list for all MoE layers or one per layer (routes given as physical ids)")
    args, rest = ap.parse_known_args(argv)
    bad = [a for a in rest if not a.startswith("--")]
    if bad:
        ap.error(f"unrecognized arguments: {' '.join(bad)}")
    args.overrides = rest  # --section.key=value overrides of --model-config
    if args.model_config and args.hf_assets_path:
        ap.error("give --model-config or --hf-assets-path, not both (a TOML takes --model.hf_assets_path=DIR)")
    spec = _spec(args)
    expert_map = None
    if args.expert_map:
        import numpy as np

        expert_map = np.asarray(json.load(open(args.expert_map)), dtype=np.int64)
        if expert_map.ndim == 1:
            expert_map = np.broadcast_to(expert_map, (spec.num_layers, len(expert_map)))
        if expert_map.ndim != 2 or expert_map.shape[0] != spec.num_layers:
            ap.error(f"--expert-map: expected one list or {spec.num_layers} lists (one per MoE layer), "
                     f"got shape {expert_map.shape}")
    try:
        rep = import_rollouts(args.format, args.inputs, args.out, spec, skip_bad=args.skip_bad,
                              rows_per_shard=args.rows_per_shard, expert_map_XP=expert_map)
    except (RolloutError, FileExistsError) as e:
        print(f"rollouts import: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a missing input, a folder given as input, --out under a file, a full disk
        print(f"rollouts import: {e.filename or args.out}: {e.strerror or e}", file=sys.stderr)
        return 2
    for err in rep.errors:
        print(f"skipped: {err}", file=sys.stderr)
    print(json.dumps({"out": args.out, "rows": rep.rows, "groups": rep.groups,
                      "skipped_samples": rep.skipped_samples, "skipped_groups": rep.skipped_groups}))
    return 0


if __name__ == "__main__":
    from ..config.loader import one_line_errors

    sys.exit(one_line_errors(main, sys.argv[1:]))
