"""Cross-field checks of ``[rl]``: the policy loss and its corrections, the rollout schedule (steps in flight,
first-finished groups, plans from the stream, partial rollouts) and file-mode rollouts fitting the job.

Why a module of its own: these checks read only the config (and the rollout folder's index), never the machine,
and they grow with every RL feature; ``validate.validate`` calls them once ``[rl] enable`` is set. The rollout
engine's keys stay in ``validate.py`` with the job's device type they depend on (tests and ``scripts/dry_run.py``
check as on GPUs by patching ``validate._job_device_type``). Every name here is also importable from
``validate.py``, as before the split.

Cost: microseconds, plus one read of ``index.json`` (and of every row the job uses, once, in the pre-flight of
file mode: ``rollouts/fit.py``).
"""

from __future__ import annotations

import math

from .job_config import JobConfig
from .loader import ConfigError, _require

# [rl] max_staleness: up to k steps of rows in flight (rollouts/sources/in_flight.py); each holds its rows on the
# host (~200 MB per rank at the real size) and k + 1 weight folders are kept: 4 bounds both, and an update on
# rows 4 steps old is already far off-policy
MAX_STALENESS = 4


def _check_rollout_dir(cfg: JobConfig, args, rows_per_step: int, scan_rows: bool) -> None:
    """File mode: the directory exists and fits the job, by the rules every rank's ``FileSource`` applies
    (``rollouts/fit.py``), over all the rows the job reads (``scan_rows``: the pre-flight, once; a trainer rank
    skips that scan, its ``FileSource`` checks its own rows)."""
    from pathlib import Path

    from ..rollouts.fit import check_fits
    from ..rollouts.store import RolloutStore

    key = "[rl] rollout_dir"
    rl, t = cfg.rl, cfg.training
    _require(bool(rl.rollout_dir), key, "must be set when rollout_source = 'file'")
    index_path = Path(rl.rollout_dir) / "index.json"
    _require(index_path.is_file(), key, f"{index_path} not found (write it with `python -m titan_foremoe.rollouts import`)")
    try:
        check_fits(RolloutStore(rl.rollout_dir), num_layers=args.n_layers, top_k=args.top_k,
                   num_experts=args.num_experts, steps=t.steps, rows_per_step=rows_per_step, seq_len=t.seq_len,
                   overlong=rl.rollout_overlong, ranges=[range(t.steps * rows_per_step)] if scan_rows else [])
    except ValueError as e:  # RolloutError, or an index.json of another version
        raise ConfigError(f"{key}: {e}") from None
    except OSError as e:  # a shard's file missing or unreadable
        raise ConfigError(f"{key}: {e}") from None
    except KeyError as e:
        raise ConfigError(f"{key}: {index_path} lacks {e}") from None


def _check_rl_loss(cfg: JobConfig) -> None:
    """The policy-loss options of ``[rl]`` (``rl/losses.py``); Literal keys are checked by the loader."""
    rl = cfg.rl
    for key, value in [("clip_eps_low", rl.clip_eps_low), ("clip_eps_high", rl.clip_eps_high)]:
        _require(value is None or (math.isfinite(value) and value > 0), f"[rl] {key}",
                 f"must be finite and > 0, got {value}")
    low = rl.clip_eps if rl.clip_eps_low is None else rl.clip_eps_low
    high = rl.clip_eps if rl.clip_eps_high is None else rl.clip_eps_high
    _require(high >= low, "[rl] clip_eps_high", f"{high} is below clip_eps_low {low} (clip-higher needs high >= low)")
    _require(rl.clip_ratio_c == 0 or (math.isfinite(rl.clip_ratio_c) and rl.clip_ratio_c > 1), "[rl] clip_ratio_c",
             f"must be 0 (off) or finite and > 1, got {rl.clip_ratio_c}")
    _require(rl.loss_norm_tokens >= 0, "[rl] loss_norm_tokens", f"must be >= 0 (0: max_new_tokens), got {rl.loss_norm_tokens}")
    _require(math.isfinite(rl.entropy_coef) and rl.entropy_coef >= 0, "[rl] entropy_coef",
             f"must be finite and >= 0, got {rl.entropy_coef}")
    _require(rl.logprob_chunk_tokens >= 1, "[rl] logprob_chunk_tokens", f"must be >= 1, got {rl.logprob_chunk_tokens}")
    _require(rl.recompute_merge >= 1, "[rl] recompute_merge", f"must be >= 1, got {rl.recompute_merge}")
    _require(rl.recompute_merge == 1 or cfg.training.pack_sequences, "[rl] recompute_merge",
             f"{rl.recompute_merge} needs [training] pack_sequences = true (padded rows would pad every merged "
             "sequence to the longest of its micro-steps)")
    _require(math.isfinite(rl.rollout_is_threshold) and rl.rollout_is_threshold > 0, "[rl] rollout_is_threshold",
             f"must be finite and > 0, got {rl.rollout_is_threshold}")
    _require(0 <= rl.overlong_buffer <= rl.max_new_tokens, "[rl] overlong_buffer",
             f"must be in [0, max_new_tokens = {rl.max_new_tokens}], got {rl.overlong_buffer}")
    _require(math.isfinite(rl.overlong_penalty) and rl.overlong_penalty >= 0, "[rl] overlong_penalty",
             f"must be finite and >= 0, got {rl.overlong_penalty}")
    _require(rl.filter_groups_max_rounds >= 0, "[rl] filter_groups_max_rounds",
             f"must be >= 0 (0: no refill), got {rl.filter_groups_max_rounds}")
    if rl.filter_groups_max_rounds > 0:
        _require(rl.filter_groups, "[rl] filter_groups_max_rounds", "refills filtered groups: needs filter_groups = true")
        _require(rl.rollout_source == "embedded", "[rl] filter_groups_max_rounds",
                 f"refills by sampling new prompts: needs rollout_source = 'embedded', got {rl.rollout_source!r}")
    _require(rl.max_staleness >= 0, "[rl] max_staleness", f"must be >= 0 (0: synchronous), got {rl.max_staleness}")
    _require(rl.max_staleness <= MAX_STALENESS, "[rl] max_staleness",
             f"at most {MAX_STALENESS} steps of rollouts in flight (each held on the host, k + 1 weight folders), "
             f"got {rl.max_staleness}")
    if rl.max_staleness > 0:
        _require(rl.rollout_source == "vllm", "[rl] max_staleness",
                 f"overlaps generation with training in an engine process of its own: needs rollout_source = "
                 f"'vllm', got {rl.rollout_source!r} (the embedded source generates on the policy being trained)")
        _require(rl.rollout_is != "off", "[rl] max_staleness",
                 f"{rl.max_staleness} trains on rollouts of an older policy: set [rl] rollout_is = 'token' or "
                 "'sequence' (the engine's log-probs correct the loss, as decoupled PPO)")
    if rl.take_first_finished:
        _require(rl.max_staleness > 0 and rl.rollout_source == "vllm", "[rl] take_first_finished",
                 f"takes finished groups from the steps in flight on live engines: needs max_staleness > 0 and "
                 f"rollout_source = 'vllm', got max_staleness = {rl.max_staleness}, {rl.rollout_source!r}")
    if rl.plan_from_stream:
        _require(rl.max_staleness > 0, "[rl] plan_from_stream",
                 "prepares the next step while this one trains, from rows generated ahead: needs max_staleness > 0")
        _require(cfg.balance.owner_policy != "balanced", "[rl] plan_from_stream",
                 "balanced owners are planned from the owners after the step's last optimizer step: not before the "
                 "update stage ends; use [balance] owner_policy = 'contiguous' or plan_from_stream = false")
    b = rl.rollout_token_budget
    _require(math.isfinite(b) and b >= 0, "[rl] rollout_token_budget",
             f"must be >= 0 (0: off; <= 1: the fraction of groups that must finish; > 1: tokens), got {b}")
    _require(rl.rollout_chunk_tokens >= 0, "[rl] rollout_chunk_tokens",
             f"must be >= 0 (0: one request per response), got {rl.rollout_chunk_tokens}")
    _require(rl.partial_max_staleness >= 1, "[rl] partial_max_staleness",
             f"must be >= 1 (a continued response has tokens of an earlier step), got {rl.partial_max_staleness}")
    if b > 0:
        _require(rl.rollout_source == "vllm", "[rl] rollout_token_budget",
                 f"partial rollouts abort and continue requests on live vLLM engines: needs rollout_source = "
                 f"'vllm', got {rl.rollout_source!r}")
        _require(rl.max_staleness == 0, "[rl] rollout_token_budget",
                 f"partial rollouts run on the synchronous loop today: needs max_staleness = 0, got "
                 f"{rl.max_staleness}")
        _require(rl.rollout_is != "off", "[rl] rollout_token_budget",
                 "continued responses hold tokens of older weights: set [rl] rollout_is = 'token' or 'sequence'")
    if rl.rollout_is != "off" and rl.rollout_source == "file" and rl.rollout_dir:
        import json
        from pathlib import Path

        index_path = Path(rl.rollout_dir) / "index.json"
        if index_path.is_file():
            _require(bool(json.loads(index_path.read_text()).get("has_logprobs")), "[rl] rollout_is",
                     f"{rl.rollout_dir} holds no behaviour log-probs (import rollouts with log-probs or set 'off')")
