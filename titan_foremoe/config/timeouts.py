"""Collective timeouts sized from the job: the longest wait one rank can spend inside one collective.

A collective timeout ends the job when a rank waits in one collective longer than ``[comm] *_timeout_seconds``.
The long waits are the phases in which some ranks do work outside any collective while the others already wait:

* **load** (first step only): reading the initial checkpoint (``[model] hf_assets_path`` / ``initial_load_path``);
* **compile** (first step only, ``[compile] enable``): the blocks compile up to 7 kinds of graphs (prefill,
  decode, recompute, update x grad; ``benchmarks/count_recompiles.py``), every rank at once and at its own
  speed: a rank waits for the spread, bounded here by the whole compile;
* **save**: DCP's save ends in a barrier that waits for the slowest rank's shard (params + AdamW, fp32) and the
  HF copy of an interval checkpoint;
* **engine**: with a live vLLM / SGLang engine the trainer ranks wait while the engine generates
  ``max_new_tokens`` and loads the synced weights;
* **decode token**: the embedded rollout decodes in lockstep (one all-reduce and the EP all-to-alls per token), so
  a rank waits at most one token through every layer there, whatever ``max_new_tokens`` is.

The figures below are stated rates, not measurements (nothing here has run at this size yet): middle-of-the-road
values for an H100 cluster with a shared parallel file system. A timeout only costs the time until a real hang
is reported, so the check asks for ``MARGIN`` times the estimate. ``config.check`` prints the estimate with
the config summary and refuses a timeout below it in one line naming the key and each part.
"""

from __future__ import annotations

from dataclasses import dataclass

STORAGE_BYTES_PER_S = 200e6  # per rank, read or write, to a shared file system (64 ranks: 12.8 GB/s in all)
COMPILE_S_PER_KIND = 20.0  # one graph kind of a block, inductor; ranks compile at once: bounds their spread
COMPILE_KINDS = 7
ENGINE_TOKEN_S = 0.03  # one decode step of a live engine at rollout batch size (Qwen3-30B-A3B class)
ENGINE_SYNC_BYTES_PER_S = 1e9  # the engine reading the synced HF folder
DECODE_LAYER_S = 2e-3  # one embedded decode step through one MoE layer (eager, EP all-to-alls)
STATE_BYTES_PER_PARAM = 12  # fp32 parameter + AdamW's two moments, as DCP saves them
HF_BYTES_PER_PARAM = 2  # the bf16 HF copy
MARGIN = 2.0


@dataclass(frozen=True)
class WaitBudget:
    """Seconds of the longest waits in one collective (the parts), and the timeouts they call for."""

    load_s: float
    compile_s: float
    save_s: float
    engine_s: float
    decode_token_s: float
    first_step_saves: bool

    @property
    def first_step_s(self) -> float:
        """Until the first step ends: load and compile may fall into one wait, then a save or the engine."""
        return self.load_s + self.compile_s + max(self.save_s if self.first_step_saves else 0.0, self.engine_s,
                                                  self.decode_token_s)

    @property
    def later_step_s(self) -> float:
        return max(self.save_s, self.engine_s, self.decode_token_s)

    def needs(self) -> tuple[int, int]:
        """(init, train) timeouts this job needs: ``MARGIN`` x the estimate, in whole seconds."""
        return int(MARGIN * self.first_step_s) + 1, int(MARGIN * self.later_step_s) + 1

    def parts(self, first: bool) -> str:
        items = [("load", self.load_s if first else 0.0), ("compile", self.compile_s if first else 0.0),
                 ("save", self.save_s if (self.first_step_saves or not first) else 0.0), ("engine", self.engine_s),
                 ("decode token", self.decode_token_s)]
        return ", ".join(f"{k} {v:.0f} s" if v >= 1 else f"{k} {v:.2f} s" for k, v in items if v > 0) or "none"


def model_params(args) -> int:
    """Parameters of a Qwen3-MoE-shaped model (``MoEModelArgs``): experts, attention, router, embeddings, head."""
    experts = args.num_experts * 3 * args.dim * args.moe_hidden_dim
    attn = args.dim * (args.n_heads + 2 * args.n_kv_heads) * args.head_dim + args.n_heads * args.head_dim * args.dim
    layer = experts + attn + args.dim * args.num_experts + 3 * args.dim * getattr(args, "shared_expert_hidden_dim", 0)
    return args.n_layers * layer + 2 * args.vocab_size * args.dim


def wait_budget(cfg, args, world_size: int) -> WaitBudget:
    """The longest single-collective waits of this job (see the module docstring for each part)."""
    params = model_params(args)
    per_rank = params / max(world_size, 1)
    c = cfg.checkpoint
    load = 0.0
    if cfg.model.hf_assets_path or c.initial_load_path:
        load = per_rank * HF_BYTES_PER_PARAM * 4 / STORAGE_BYTES_PER_S  # whole files per shard: x4 read
    save = 0.0
    if c.enable:
        save = per_rank * (STATE_BYTES_PER_PARAM + HF_BYTES_PER_PARAM) / STORAGE_BYTES_PER_S
    steps = cfg.training.steps + (cfg.rl.sft_warmup_steps if cfg.rl.enable else 0)
    engine = 0.0
    if cfg.rl.enable and cfg.rl.rollout_source in ("vllm", "sglang"):
        engine = cfg.rl.max_new_tokens * ENGINE_TOKEN_S + params * HF_BYTES_PER_PARAM / ENGINE_SYNC_BYTES_PER_S
    decode = args.n_layers * DECODE_LAYER_S if cfg.rl.enable else 0.0
    compile_s = COMPILE_KINDS * COMPILE_S_PER_KIND if cfg.compile.enable else 0.0
    return WaitBudget(load, compile_s, save, engine, decode, c.enable and (c.interval == 1 or steps == 1))


def check_timeouts(cfg, args, world_size: int) -> WaitBudget:
    """Refuse ``[comm]`` timeouts below what this job's longest waits need (``ConfigError``, one line)."""
    from .loader import ConfigError

    b = wait_budget(cfg, args, world_size)
    init_need, train_need = b.needs()
    for key, have, need, first in (("init_timeout_seconds", cfg.comm.init_timeout_seconds, init_need, True),
                                   ("train_timeout_seconds", cfg.comm.train_timeout_seconds, train_need, False)):
        if have < need:
            span = "until the first step ends" if first else "from step 2 on"
            raise ConfigError(
                f"[comm] {key}: {have} s is below the {need} s this job needs {span} ({MARGIN:g} x the longest "
                f"wait in one collective: {b.parts(first)}; config/timeouts.py states the rates): set it >= {need}")
    return b
