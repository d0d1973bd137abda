"""Pre-flight config check.

``python -m titan_foremoe.config.check FILE --world-size N [--preflight] [--section.key=value ...]``

Exit 0 and print a one-line summary when valid; exit 2 with one line naming
the key and the problem otherwise. ``--preflight`` adds the file-system checks
(output folders writable, the latest checkpoint can serve this job) and exits 3
when the checkpoint says the job already finished. ``run_train.sh`` runs it before torchrun.
"""

from __future__ import annotations

import sys

from ..distributed import environment
from .loader import ConfigError, load_config
from .preflight import JobFinished, preflight


def load_dataset(cfg, tokenizer):
    """``[data] path`` read and tokenized (None: the embedded task); a bad row is a ``ConfigError``.

    The one reading of the dataset: the pre-flight and every worker must accept and skip the same rows."""
    if not cfg.data.path:
        return None
    from ..data.prompts import DatasetError, build_prompt_dataset

    try:
        return build_prompt_dataset(
            cfg.data, tokenizer, seq_len=cfg.training.seq_len,
            max_new_tokens=cfg.rl.max_new_tokens if cfg.rl.enable else 1,
            sft=not cfg.rl.enable or cfg.rl.sft_warmup_steps > 0, seed=cfg.job.seed,
        )
    except DatasetError as e:
        raise ConfigError(f"[data] path: {e}") from None


def load_tokenizer(cfg):
    """``[model] hf_assets_path``'s tokenizer with ``[data] chat_template``; a ``ConfigError`` naming the file."""
    from ..data.hf_tokenizer import HFTokenizer, TokenizerError

    try:
        return HFTokenizer(cfg.model.hf_assets_path, cfg.data.chat_template)
    except TokenizerError as e:
        key = "[data] chat_template" if str(e).startswith("[data]") else "[model] hf_assets_path"
        raise ConfigError(f"{key}: {str(e).removeprefix('[data] chat_template: ')}") from None


def check_data_resume(cfg, ds, resume: int) -> None:
    """A resume from ``step-{resume}`` reads the prompt file its checkpoint was taken on (same rows, same order)."""
    if ds is None or resume < 0:
        return
    import os

    from .preflight import checkpoint_folder, dataset_problem

    problem = dataset_problem(os.path.join(checkpoint_folder(cfg), f"step-{resume}"), ds)
    if problem:
        raise ConfigError(problem)


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print("usage: python -m titan_foremoe.config.check FILE --world-size N [--preflight] [--section.key=value ...]")
        print(__doc__.split("\n\n", 2)[2])
        return 0
    world_size = 1
    rest: list[str] = []
    path = None
    files = False
    i = 0
    while i < len(argv):
        if argv[i] == "--preflight":
            files = True
            i += 1
            continue
        if argv[i] == "--world-size":
            world_size = int(argv[i + 1])
            i += 2
            continue
        if path is None and not argv[i].startswith("--"):
            path = argv[i]
        else:
            rest.append(argv[i])
        i += 1
    resume = -1
    if env := environment.problem():  # before anything imports torchtitan: one line naming the versions
        print(env, file=sys.stderr)
        return 2
    from ..models.attention_kernels import job_attention_problem, local_cuda_device
    from .timeouts import wait_budget
    from .validate import model_args, token_budget, validate

    try:
        cfg = load_config(path, rest)
        r = validate(cfg, world_size)
        gpu = local_cuda_device()
        if gpu is not None and (why := job_attention_problem(cfg, model_args(cfg).head_dim, gpu)):
            raise ConfigError(why)  # before any rank starts: the attention this job needs cannot run on this GPU
        ds = load_dataset(cfg, load_tokenizer(cfg)) if cfg.data.path else None  # a bad row: before any worker
        rows = f" rows={len(ds)} skipped_rows={ds.skipped}" if ds is not None else ""
        if files:
            resume = preflight(cfg)
            check_data_resume(cfg, ds, resume)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except JobFinished as e:
        print(e)
        from ..train.summary import complete_finished_job

        done = complete_finished_job(cfg, r)  # a job killed after its final checkpoint, before summary.json
        if done:
            print(done)
        return 3
    init_need, train_need = wait_budget(cfg, model_args(cfg), world_size).needs()
    budget = token_budget(cfg)
    micro = f"by a {budget}-token budget per rank" if budget else str(r.micro_steps)
    fleet = ""
    if cfg.rl.enable and cfg.rl.rollout_source in ("vllm", "sglang"):
        import os

        from ..rollouts.fleet.layout import describe, fleet_of
        from ..rollouts.sources import engine_section

        per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or min(world_size, 8)
        fleet = f" fleet={describe(fleet_of(engine_section(cfg), world_size, per_node))}"
    if compat := environment.compat_line():
        print(compat)
    print(
        f"config ok: world={r.world_size} dp_shard={r.dp_shard} ep={r.ep} "
        f"experts={r.num_experts} top_k={r.top_k} micro_steps={micro}{rows} "
        f"timeouts_needed={init_need}/{train_need}s{fleet}"
        + (f"; resuming from checkpoint step-{resume}" if resume >= 0 else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
