"""Cross-field checks that need more than one key (or the world size).

Run by ``run_train.sh`` before torchrun starts any worker, and again inside
every worker once the real world size is known. The ``[rl]`` section's own checks (policy loss, rollout
schedule, file-mode rollouts) are in ``validate_rl.py``; every failure is one ``ConfigError`` line
(``loader._require``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ..models.flavors import get_flavor
from .job_config import JobConfig
from .loader import ConfigError, _require
from .timeouts import check_timeouts
from .validate_rl import MAX_STALENESS, _check_rl_loss, _check_rollout_dir  # noqa: F401 (MAX_STALENESS: tests)


@dataclass(frozen=True)
class Resolved:
    """Derived sizes every component agrees on."""

    world_size: int
    dp_shard: int
    dp_replicate: int
    ep: int
    dp_degree: int
    num_experts: int
    top_k: int
    n_layers: int
    micro_steps: int
    global_batch_size: int
    rollout_sequences: int
    ranks_per_node: int  # EP ranks per node for the planner's topology (``ep_ranks_per_node``)


_HF_KEYS = [("n_layers", "num_hidden_layers"), ("dim", "hidden_size"), ("num_experts", "num_experts"),
            ("top_k", "num_experts_per_tok"), ("moe_hidden_dim", "moe_intermediate_size")]


def ep_ranks_per_node(configured: int, ep: int, local_world_size: str | None) -> int:
    """EP ranks per node: ``[balance] ranks_per_node``, else from torchrun's ``LOCAL_WORLD_SIZE`` (processes per
    node). EP is the innermost mesh dimension (consecutive ranks), so a node holds ``min(LOCAL_WORLD_SIZE, ep)`` of
    an EP group's ranks. Neither set: one node."""
    if configured:
        _require(configured >= 1 and ep % configured == 0, "[balance] ranks_per_node",
                 f"{configured} does not divide the EP degree {ep}")
        return configured
    if not local_world_size:
        return ep
    try:
        lws = int(local_world_size)
    except ValueError:
        raise ConfigError(f"LOCAL_WORLD_SIZE: {local_world_size!r} is not an integer") from None
    rpn = min(lws, ep)
    _require(lws >= 1 and (ep % lws == 0 or lws % ep == 0), "[balance] ranks_per_node",
             f"0 takes torchrun's LOCAL_WORLD_SIZE = {local_world_size}, which neither divides nor is a multiple of "
             f"the EP degree {ep}: set ranks_per_node")
    return rpn


SLOT_COST_DEVICES = ("h100", "h200")  # the measured calibrations of simulator/calibration.py


def _check_slot_cost(b) -> None:
    """``[balance] slot_overhead_tokens``: "auto" or an int >= 0; ``slot_cost_device``: a measured calibration."""
    s = b.slot_overhead_tokens
    ok = s == "auto" or (isinstance(s, int) and not isinstance(s, bool) and s >= 0)
    _require(ok, "[balance] slot_overhead_tokens",
             f'must be "auto" (the calibrated cost of [balance] slot_cost_device) or an int >= 0 (tokens; 0: token '
             f"counts), got {s!r}")
    _require(b.slot_cost_device in SLOT_COST_DEVICES, "[balance] slot_cost_device",
             f"must be one of {', '.join(map(repr, SLOT_COST_DEVICES))} (a measured calibration), "
             f"got {b.slot_cost_device!r}")
    _require(isinstance(b.pass_polish, bool), "[balance] pass_polish", f"must be true or false, got {b.pass_polish!r}")
    starts = b.slot_cost_starts
    _require(isinstance(starts, list) and len(starts) > 0 and all(
        isinstance(x, (int, float)) and not isinstance(x, bool) and x > 0 for x in starts),
        "[balance] slot_cost_starts", f"must be a non-empty list of positive multiples of the slot cost (e.g. "
        f"[0.5, 1, 2]), got {starts!r}")
    d = b.polish_chain_depth
    _require(isinstance(d, int) and not isinstance(d, bool) and d >= 1, "[balance] polish_chain_depth",
             f"must be an int >= 1 (1: the straggler only), got {d!r}")


def hf_model_args(cfg: JobConfig):
    """The shape of ``[model] hf_assets_path``'s ``config.json``; a ``[model]`` size that disagrees is refused."""
    from ..models.hf import HFCheckpointError, model_args_from_hf

    m = cfg.model
    _require(os.path.isdir(m.hf_assets_path), "[model] hf_assets_path",
             f"{m.hf_assets_path!r} is not a folder (a tiny one for trying things out: "
             "python scripts/make_tiny_hf_checkpoint.py --out DIR)")
    try:
        args = model_args_from_hf(m.hf_assets_path)
    except HFCheckpointError as e:
        raise ConfigError(f"[model] hf_assets_path: {e}") from None
    except KeyError as e:
        raise ConfigError(f"[model] hf_assets_path: config.json lacks {e}") from None
    for ours, theirs in _HF_KEYS:
        value = getattr(m, ours)
        _require(value is None or value == getattr(args, ours), f"[model] {ours}",
                 f"{value} disagrees with the checkpoint: {m.hf_assets_path}/config.json has "
                 f"{theirs} = {getattr(args, ours)}")
    _require(not m.shared_expert_hidden_dim, "[model] shared_expert_hidden_dim",
             f"{m.shared_expert_hidden_dim} disagrees with the checkpoint: Qwen3-MoE has no shared expert")
    return args


def model_args(cfg: JobConfig, vocab_size: int | None = None):
    """The model's shape: from ``[model] hf_assets_path``'s config.json, else the flavor + overrides."""
    m = cfg.model
    if m.hf_assets_path:
        return hf_model_args(cfg)
    return get_flavor(
        m.flavor,
        n_layers=m.n_layers,
        dim=m.dim,
        num_experts=m.num_experts,
        top_k=m.top_k,
        moe_hidden_dim=m.moe_hidden_dim,
        shared_expert_hidden_dim=m.shared_expert_hidden_dim,
        vocab_size=vocab_size,
    )


def _check_rollout_engine(cfg: JobConfig) -> None:
    """``[rl] rollout_source = "vllm"`` or ``"sglang"``: an HF model (the engine loads its folders) and a usable
    engine, by the keys of that engine's section."""
    source = cfg.rl.rollout_source
    section = "sglang_engine" if source == "sglang" else "rollout_engine"
    e, sec = getattr(cfg, section), f"[{section}]"
    how = ("point it at a python with SGLang installed (docs/rollouts_sglang.md)" if source == "sglang"
           else "build it with scripts/setup_vllm_cpu.sh")
    _require(bool(cfg.model.hf_assets_path), "[rl] rollout_source",
             f"{source!r} needs [model] hf_assets_path (the engine loads HF folders of the policy)")
    _require(not (e.url and e.urls), f"{sec} urls", "set url (one engine you run) or urls (several), not both")
    _check_fleet(e, sec, source)
    if e.urls and not e.url:
        for u in e.urls:
            _require(u.startswith(("http://", "https://")), f"{sec} urls", f"{u!r} is not an http URL")
        return _check_engine_keys(cfg, e, sec, source)
    _require(bool(e.url) or e.launch, f"{sec} url", "set url (an engine you run) or launch = true")
    if not e.url:
        _require(bool(e.python), f"{sec} python", f"must name the engine's interpreter: {how}")
        _require(os.path.isfile(os.path.expanduser(e.python)), f"{sec} python", f"{e.python!r} does not exist: {how}")
    else:
        _require(e.url.startswith(("http://", "https://")), f"{sec} url", f"{e.url!r} is not an http URL")
    _check_engine_keys(cfg, e, sec, source)


def _check_fleet(e, sec: str, source: str) -> None:
    """The fleet's keys (``rollouts/fleet``): counts >= 1 (engines >= 0), one server for SGLang, and ``ipc`` to one
    engine unless colocated (docs/rollouts_vllm.md, The engine fleet)."""
    _require(e.engines >= 0, f"{sec} engines", f"must be >= 0, got {e.engines}")
    _require(e.gpus_per_engine >= 1, f"{sec} gpus_per_engine", f"must be >= 1, got {e.gpus_per_engine}")
    fleet = len(e.urls) if e.urls else (1 if e.url else e.engines)
    if source == "sglang":
        _require(fleet <= 1 and not e.colocated, f"{sec} engines", "one SGLang server per job (engines = 1, at "
                 "most one url, colocated = false): several SGLang servers need a fleet variant (docs/"
                 "rollouts_sglang.md, Several servers); use [rl] rollout_source = 'vllm' for an engine fleet")
    elif e.weight_sync == "ipc":
        _require(fleet <= 1 or e.colocated, f"{sec} weight_sync", f"'ipc' feeds engines on the trainer's own GPUs: "
                 f"{fleet} engines need colocated = true (one per block of gpus_per_engine GPUs, each fed from its "
                 "own node), or 'nccl' (one transfer group of every engine) or 'reload' for engines on GPUs of their own")


def _check_engine_keys(cfg: JobConfig, e, sec: str, source: str) -> None:
    _require(e.max_model_len > cfg.rl.max_new_tokens, f"{sec} max_model_len",
             f"{e.max_model_len} leaves no room for a prompt with max_new_tokens {cfg.rl.max_new_tokens}")
    for key, value in [("concurrency", e.concurrency), ("startup_timeout_s", e.startup_timeout_s),
                       ("request_timeout_s", e.request_timeout_s), ("probe_tolerance", e.probe_tolerance)]:
        _require(value > 0, f"{sec} {key}", f"must be > 0, got {value}")
    for key, value in [("retries", e.retries), ("max_restarts", e.max_restarts)]:
        _require(value >= 0, f"{sec} {key}", f"must be >= 0, got {value}")
    if hasattr(e, "hang_timeout_s"):
        _require(e.hang_timeout_s >= 0, f"{sec} hang_timeout_s", f"must be >= 0 (0: off), got {e.hang_timeout_s}")
        _require(e.hang_timeout_s < e.request_timeout_s, f"{sec} hang_timeout_s",
                 f"{e.hang_timeout_s:g} is not below request_timeout_s {e.request_timeout_s:g}: the request "
                 "timeout would end a hung engine's requests first; lower it, or 0 to turn the watch off")
    if e.weight_sync in ("nccl", "distributed"):
        _check_stream_sync(e, source)
    if e.weight_sync == "ipc":
        _check_ipc_sync(e)
    if source != "sglang":
        _check_sleep(cfg, e)
    if source != "sglang" and e.weight_sync in ("nccl", "ipc") and e.fused_expert_load and not e.url:
        _require("--worker-extension-cls" not in " ".join(e.extra_args), f"{sec} extra_args",
                 "--worker-extension-cls conflicts with fused_expert_load = true (the launch passes ours, vLLM "
                 "takes one class): drop it, or set fused_expert_load = false")


def _check_sleep(cfg: JobConfig, e) -> None:
    """``sleep_level``: 0-2, and > 0 only for colocated engines on GPUs with a synchronous rollout
    (``rollouts/fleet/sleep.py``)."""
    from ..rollouts.fleet.sleep import sleep_refusal

    colocated = e.colocated or e.weight_sync == "ipc"  # ipc engines share the trainer's GPUs by definition
    why = sleep_refusal(e.sleep_level, device=_job_device_type(), colocated=colocated,
                        max_staleness=cfg.rl.max_staleness)
    if why:
        raise ConfigError(why)


def _warn_file_sync(cfg: JobConfig, args, world_size: int) -> None:
    """A folder sync (``reload`` / ``disk``) above one node moves the whole policy through the file system every
    step: said in one line with the bytes (docs/rollouts_vllm.md: the bucketed NCCL sync instead)."""
    import logging

    from ..rollouts.engines.sync_cost import policy_bytes

    sglang = cfg.rl.rollout_source == "sglang"
    e = cfg.sglang_engine if sglang else cfg.rollout_engine
    node = cfg.balance.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or 8
    if e.weight_sync not in ("reload", "disk") or world_size <= node:
        return
    nbytes = policy_bytes(args, 2 if e.dtype == "bfloat16" else 4)
    logging.getLogger("titan_foremoe").warning(
        "[%s] weight_sync = %r on %d ranks (%d nodes): every step writes and the engine reads %.1f GB through "
        "the file system (%.2f GB per rank); weight_sync = %r moves it over the network in buckets",
        "sglang_engine" if sglang else "rollout_engine", e.weight_sync, world_size, -(-world_size // node),
        nbytes / 1e9, nbytes / world_size / 1e9, "distributed" if sglang else "nccl")


def token_budget(cfg: JobConfig) -> int:
    """``max_tokens_per_micro_step`` where it forms the micro-steps (RL), else 0: the start-up line and the
    pre-flight then say the budget, not the row count (which would say 2 where 8 run)."""
    return cfg.training.max_tokens_per_micro_step if cfg.rl.enable else 0


def _check_task_seq_len(cfg: JobConfig) -> None:
    """An embedded task's examples (supervised steps) and rollouts (the longest prompt + ``max_new_tokens``) fit
    ``seq_len``: one line naming the larger need (two checks used to name 19 and then refuse 19 for 20)."""
    from ..data.tasks import build_task

    task, rl = build_task(cfg.data), cfg.rl
    needs = {}
    if not (rl.enable and rl.rollout_source == "file" and rl.sft_warmup_steps == 0):  # supervised steps run
        needs["the longest example"] = task.max_sequence_length() - 1  # inputs: the sequence minus its last token
    if rl.enable and rl.rollout_source == "embedded":
        needs["the longest prompt + [rl] max_new_tokens - 1"] = (task.max_sequence_length() - task.max_answer_tokens()
                                                                 + rl.max_new_tokens - 1)
    if not needs:
        return
    need = max(needs.values())
    _require(need <= cfg.training.seq_len, "[training] seq_len",
             f"{cfg.training.seq_len} is too short for {cfg.data.task}: it needs {need} input tokens ("
             + "; ".join(f"{what}: {n}" for what, n in needs.items()) + f"): set seq_len = {need} or more")


def _job_device_type() -> str:
    """The job's device type as torchtitan picks it ("cuda" when a GPU is visible, else "cpu")."""
    from torchtitan.tools import utils as tt_utils

    return tt_utils.device_type


def _trainer_has(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def _check_stream_sync(e, source: str) -> None:
    """``weight_sync = "nccl"`` (vLLM) / ``"distributed"`` (SGLang): the engine's NCCL weight transfer needs GPUs
    and the engine package's trainer-side group helper."""
    package, sec = ("sglang", "[sglang_engine]") if source == "sglang" else ("vllm", "[rollout_engine]")
    mode = e.weight_sync
    _require(e.gpus_per_engine >= 1, f"{sec} gpus_per_engine", f"must be >= 1, got {e.gpus_per_engine}")
    _require(bool(e.nccl_address), f"{sec} nccl_address", f"must be set with weight_sync = {mode!r}")
    _require(e.weight_sync_bucket_mb >= 1, f"{sec} weight_sync_bucket_mb",
             f"must be >= 1, got {e.weight_sync_bucket_mb}")
    senders = getattr(e, "weight_sync_senders", 1)
    _require(senders >= 1, f"{sec} weight_sync_senders", f"must be >= 1, got {senders}")
    if _job_device_type() != "cuda" and (e.url or e.urls) and not e.launch:
        return  # checked on a machine without GPUs for an engine the user runs: the trainer checks where it runs
    _require(_job_device_type() == "cuda", f"{sec} weight_sync",
             f"{mode!r} needs GPUs (the engine's NCCL weight transfer is CUDA-only); this job's device is "
             f"{_job_device_type()}: use {'disk' if source == 'sglang' else 'reload'!r} or 'restart'")
    _require(_trainer_has(package), f"{sec} weight_sync",
             f"{mode!r} needs {package} importable by the trainer's python (its group helper): pip install "
             f"{package} in the trainer's environment, or use {'disk' if source == 'sglang' else 'reload'!r}")


def _check_ipc_sync(e) -> None:
    """``weight_sync = "ipc"``: IPC handles open only on the trainer's node, on GPUs (CUDA IPC): a launched engine
    (on rank 0's host) on a GPU job, or a user-run engine on the loopback (on CPU only a stand-in that opens the
    shared-memory form, tests/vllm_ipc_standin.py)."""
    from urllib.parse import urlparse

    sec = "[rollout_engine]"
    _require(e.weight_sync_bucket_mb >= 1, f"{sec} weight_sync_bucket_mb",
             f"must be >= 1, got {e.weight_sync_bucket_mb}")
    _require(e.gpus_per_engine >= 1, f"{sec} gpus_per_engine", f"must be >= 1, got {e.gpus_per_engine}")
    if e.url:
        host = urlparse(e.url).hostname or ""
        _require(host in ("127.0.0.1", "localhost", "::1"), f"{sec} url",
                 f"weight_sync = 'ipc' hands over IPC handles, which open only on the trainer's own node: the "
                 f"engine must be colocated (run it on rank 0's node, url on 127.0.0.1), not at {host!r}; for an "
                 "engine elsewhere use 'nccl'")
        return
    _require(_job_device_type() == "cuda", f"{sec} weight_sync",
             f"'ipc' needs GPUs (vLLM's IPC weight transfer shares CUDA memory); this job's device is "
             f"{_job_device_type()}: use 'reload' or 'restart'")


def _check_ipc_world(e, world_size: int) -> None:
    """Every engine's workers find their GPUs' handles among the ranks of its own block (one handle per GPU): the
    fleet's layout (``rollouts/fleet/layout.py``, what ``ipc_weights.ipc_node`` feeds) fits the job's nodes."""
    per_node = min(int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or world_size, world_size)
    _require(e.gpus_per_engine <= per_node, "[rollout_engine] gpus_per_engine",
             f"{e.gpus_per_engine} GPUs per engine with weight_sync = 'ipc', but a node has {per_node} trainer "
             "GPUs: a colocated engine's workers run on one node's GPUs (a worker elsewhere would find no handle "
             "of its GPU)")
    from ..rollouts.fleet.layout import LayoutError, fleet_of

    try:
        fleet_of(e, world_size, per_node)
    except LayoutError as err:
        raise ConfigError(str(err)) from None


def _check_hf_checkpoint(cfg: JobConfig, args) -> None:
    """HF load/save keys agree with each other, and the weight files are whole and shaped as config.json says."""
    c, m = cfg.checkpoint, cfg.model
    if c.initial_load_in_hf:
        _require(c.enable, "[checkpoint] initial_load_in_hf", "needs [checkpoint] enable = true")
        src = c.initial_load_path or m.hf_assets_path
        _require(bool(src), "[checkpoint] initial_load_in_hf",
                 "needs [checkpoint] initial_load_path or [model] hf_assets_path")
        key = "[checkpoint] initial_load_path" if c.initial_load_path else "[model] hf_assets_path"
        _require(os.path.isdir(src), key, f"{src!r} is not a folder")
        if c.initial_load_path and m.hf_assets_path:
            from ..models.hf import model_args_from_hf

            try:
                theirs = model_args_from_hf(src)
            except Exception as e:  # noqa: BLE001 - reported with the key
                raise ConfigError(f"{key}: {e}") from None
            for ours, name in _HF_KEYS + [("vocab_size", "vocab_size"), ("n_heads", "num_attention_heads")]:
                _require(getattr(theirs, ours) == getattr(args, ours), key,
                         f"{src}/config.json has {name} = {getattr(theirs, ours)}, "
                         f"[model] hf_assets_path has {getattr(args, ours)}")
        from ..models.hf import HFCheckpointError, check_tensor_shapes

        try:
            check_tensor_shapes(src, args)
        except HFCheckpointError as e:
            raise ConfigError(f"{key}: {e}") from None
    elif c.initial_load_path:
        _require(os.path.isabs(c.initial_load_path) or os.path.isdir(c.initial_load_path),
                 "[checkpoint] initial_load_path", f"{c.initial_load_path!r} is not a folder")
    if c.last_save_in_hf:
        _require(c.last_save_model_only, "[checkpoint] last_save_in_hf", "needs last_save_model_only = true")
        _require(bool(m.hf_assets_path), "[checkpoint] last_save_in_hf",
                 "needs [model] hf_assets_path (config and tokenizer files of the saved folder)")


def _check_balance_bounds(cfg: JobConfig, args, ep: int) -> None:
    """Placement needs replayed routes, and its sizes end where the model does (issue 23).

    Without router replay the routes differ from the loads the plan was made for (step 1 would crash);
    a rank holds at most every expert, so ``spare_slots`` beyond ``E - E/ep`` only allocates idle slots
    (1e6 slots asked for 14.6 TiB at the real size)."""
    b = cfg.balance
    _require(cfg.rl.router_replay, "[rl] router_replay",
             f"false needs [balance] balancer = 'off': balancer {b.balancer!r} plans for the rollout's routes, "
             "which the trainer only follows when they are replayed")
    owned = args.num_experts // ep
    most = args.num_experts - owned
    _require(b.spare_slots <= most, "[balance] spare_slots",
             f"{b.spare_slots} exceeds what the model can use: {args.num_experts} experts, {owned} owned per rank "
             f"(ep = {ep}), so at most {most}")


MAX_STEPS = 10**9  # 2^63 steps passed every check and failed at the first save (issue 40)


def validate(cfg: JobConfig, world_size: int, *, scan_rollout_rows: bool = True) -> Resolved:
    """Raise ``ConfigError`` naming the first bad key; return the resolved sizes.

    ``scan_rollout_rows``: read the length of every rollout row the job will use (file mode; the pre-flight);
    trainer ranks pass False, each ``FileSource`` checks its own rows."""
    _require(world_size >= 1, "world size", f"must be >= 1, got {world_size}")
    t, p, m = cfg.training, cfg.parallelism, cfg.model
    for key, value in [
        ("[training] steps", t.steps),
        ("[training] local_batch_size", t.local_batch_size),
        ("[training] seq_len", t.seq_len),
        ("[parallelism] expert_parallel_degree", p.expert_parallel_degree),
        ("[parallelism] data_parallel_replicate_degree", p.data_parallel_replicate_degree),
        ("[metrics] log_freq", cfg.metrics.log_freq),
        ("[checkpoint] interval", cfg.checkpoint.interval),
        ("[comm] init_timeout_seconds", cfg.comm.init_timeout_seconds),
        ("[comm] train_timeout_seconds", cfg.comm.train_timeout_seconds),
        ("[comm] join_timeout_seconds", cfg.comm.join_timeout_seconds),
    ]:
        _require(value >= 1, key, f"must be >= 1, got {value}")
    for key, value in (("[training] steps", t.steps), ("[rl] sft_warmup_steps", cfg.rl.sft_warmup_steps)):
        _require(value <= MAX_STEPS, key, f"must be <= {MAX_STEPS:,} (a job's steps, saved in its checkpoints' "
                                          f"counters and LR schedule), got {value:,}")
    for key, value in [
        ("[model] n_layers", m.n_layers),
        ("[model] dim", m.dim),
        ("[model] num_experts", m.num_experts),
        ("[model] top_k", m.top_k),
        ("[model] moe_hidden_dim", m.moe_hidden_dim),
    ]:
        _require(value is None or value >= 1, key, f"must be >= 1, got {value}")
    _require(cfg.comm.trace_buf_size >= 0, "[comm] trace_buf_size", f"must be >= 0, got {cfg.comm.trace_buf_size}")
    _require(
        m.shared_expert_hidden_dim is None or m.shared_expert_hidden_dim >= 0,
        "[model] shared_expert_hidden_dim",
        f"must be >= 0, got {m.shared_expert_hidden_dim}",
    )
    _require(
        m.load_balance_coeff is None or (math.isfinite(m.load_balance_coeff) and m.load_balance_coeff > 0),
        "[model] load_balance_coeff",
        f"must be > 0 or omitted, got {m.load_balance_coeff}",
    )
    o, s = cfg.optimizer, cfg.lr_scheduler
    _require(math.isfinite(o.lr) and o.lr >= 0, "[optimizer] lr",
             f"must be finite and >= 0 (0: evaluation / export runs), got {o.lr}")
    for key, value in [("[optimizer] beta1", o.beta1), ("[optimizer] beta2", o.beta2)]:
        _require(0 <= value < 1, key, f"must be in [0, 1), got {value}")
    _require(math.isfinite(o.eps) and o.eps > 0, "[optimizer] eps", f"must be finite and > 0, got {o.eps}")
    _require(math.isfinite(o.weight_decay) and o.weight_decay >= 0, "[optimizer] weight_decay",
             f"must be finite and >= 0, got {o.weight_decay}")
    _require(math.isfinite(t.max_norm) and t.max_norm > 0, "[training] max_norm",
             f"must be finite and > 0, got {t.max_norm}")
    _require(t.nonfinite_max_skips >= 0, "[training] nonfinite_max_skips",
             f"must be >= 0 (0: no bound), got {t.nonfinite_max_skips}")
    _require(isinstance(t.pack_sequences, bool), "[training] pack_sequences",
             f"must be true or false, got {t.pack_sequences!r}")
    _require(s.warmup_steps >= 0, "[lr_scheduler] warmup_steps", f"must be >= 0, got {s.warmup_steps}")
    d = s.decay_ratio
    _require(d is None or 0 < d <= 1, "[lr_scheduler] decay_ratio", f"must be in (0, 1], got {d}")
    _require(0 <= s.min_lr_factor <= 1, "[lr_scheduler] min_lr_factor", f"must be in [0, 1], got {s.min_lr_factor}")
    c = cfg.checkpoint
    _require(c.keep_latest_k == 0 or c.keep_latest_k >= 2, "[checkpoint] keep_latest_k",
             f"must be 0 (keep all) or >= 2, got {c.keep_latest_k} (torchtitan keeps at least 2: "
             "with asynchronous saves the newest checkpoint may still be being written when older ones are purged)")
    _require(bool(c.folder.strip()), "[checkpoint] folder", "must not be empty")
    _require(bool(cfg.job.dump_folder.strip()), "[job] dump_folder", "must not be empty")

    _require(not (cfg.compile.enable and m.expert_dtype == "float32"), "[compile] enable",
             "torch.compile needs [model] expert_dtype = 'bfloat16' (torch._grouped_mm's compiled kernel is bf16-only)")

    _require(not (cfg.compile.enable and cfg.rl.enable and cfg.activation_checkpoint.mode == "selective"),
             "[activation_checkpoint] mode",
             "'selective' under RL's torch.compile fails in the recompute (the compiled graphs between the placement "
             "seams issue other ops than the forward's, which selective AC's op log cannot match): use 'full' or "
             "[compile] enable = false")

    args = model_args(cfg)
    _require(args.top_k <= args.num_experts, "[model] top_k",
             f"top_k ({args.top_k}) exceeds the number of experts ({args.num_experts})")
    _require(t.seq_len <= args.max_seq_len, "[training] seq_len",
             f"{t.seq_len} exceeds the model's max_seq_len {args.max_seq_len}")

    ep = p.expert_parallel_degree
    _require(world_size % ep == 0, "[parallelism] expert_parallel_degree",
             f"EP degree {ep} does not divide the world size {world_size}")
    _require(args.num_experts % ep == 0, "[parallelism] expert_parallel_degree",
             f"number of experts {args.num_experts} is not divisible by EP degree {ep}")
    rep = p.data_parallel_replicate_degree
    _require(world_size % rep == 0, "[parallelism] data_parallel_replicate_degree",
             f"{rep} does not divide the world size {world_size}")
    shard = p.data_parallel_shard_degree
    if shard == -1:
        shard = world_size // rep
    _require(shard >= 1, "[parallelism] data_parallel_shard_degree", f"must be -1 or >= 1, got {shard}")
    _require(shard * rep == world_size, "[parallelism] data_parallel_shard_degree",
             f"shard {shard} x replicate {rep} != world size {world_size}")
    _require(shard % ep == 0, "[parallelism] expert_parallel_degree",
             f"EP degree {ep} must divide the data-parallel shard degree {shard}")

    dp = shard * rep
    gbs = t.global_batch_size if t.global_batch_size != -1 else t.local_batch_size * dp
    _require(gbs >= 1 and gbs % (t.local_batch_size * dp) == 0, "[training] global_batch_size",
             f"{gbs} is not a multiple of local_batch_size x data-parallel degree "
             f"({t.local_batch_size} x {dp})")

    budget = t.max_tokens_per_micro_step
    _require(budget == 0 or budget >= t.seq_len, "[training] max_tokens_per_micro_step",
             f"{budget} is below seq_len {t.seq_len}: a sequence of seq_len tokens could not fit in a micro-step "
             "(0: micro-steps of local_batch_size rows)")
    _require(budget == 0 or t.pack_sequences, "[training] max_tokens_per_micro_step",
             "a token budget needs pack_sequences = true (a padded micro-step computes rows x its longest row, "
             "which the budget does not bound)")
    _check_hf_checkpoint(cfg, args)
    check_timeouts(cfg, args, world_size)  # the first step's and later steps' longest waits (config/timeouts.py)
    dmin, dmax = cfg.data.min_digits, cfg.data.max_digits
    _require(1 <= dmin <= dmax, "[data] min_digits", f"need 1 <= min_digits <= max_digits, got {dmin}, {dmax}")
    from ..data.tasks import build_task

    from_file = bool(cfg.data.path)
    _require(from_file or not m.hf_assets_path, "[data] path",
             "an HF model ([model] hf_assets_path) needs a prompt file; the embedded tasks use the debug tokenizer")
    if from_file:  # rows are checked against the context when the file is read (config.check, then workers)
        _require(bool(m.hf_assets_path), "[data] path", "a prompt file needs [model] hf_assets_path (tokenizer)")
        _require(os.path.isfile(cfg.data.path), "[data] path", f"{cfg.data.path!r} does not exist")
        _require(cfg.data.path.endswith((".jsonl", ".json", ".parquet")), "[data] path",
                 f"{cfg.data.path!r}: expected a .jsonl or .parquet file")
    else:
        _check_task_seq_len(cfg)
    rl = cfg.rl
    rollout_sequences = gbs
    _require(rl.enable or rl.rollout_source == "embedded", "[rl] rollout_source",
             f"{rl.rollout_source!r} needs [rl] enable = true (rollouts feed the RL stages)")
    if rl.enable:
        _require(rl.samples_per_prompt >= 2, "[rl] samples_per_prompt",
                 f"group-relative advantages need >= 2 samples per prompt, got {rl.samples_per_prompt}")
        for key, value in [("[rl] updates_per_rollout", rl.updates_per_rollout),
                           ("[rl] max_new_tokens", rl.max_new_tokens)]:
            _require(value >= 1, key, f"must be >= 1, got {value}")
        _require(rl.sft_warmup_steps >= 0, "[rl] sft_warmup_steps", f"must be >= 0, got {rl.sft_warmup_steps}")
        _require(math.isfinite(rl.temperature) and rl.temperature >= 0, "[rl] temperature",
                 f"must be finite and >= 0, got {rl.temperature}")
        _require(0 < rl.top_p <= 1, "[rl] top_p", f"must be in (0, 1], got {rl.top_p}")
        _require(math.isfinite(rl.clip_eps) and rl.clip_eps > 0, "[rl] clip_eps",
                 f"must be finite and > 0, got {rl.clip_eps}")
        _require(math.isfinite(rl.kl_coef) and rl.kl_coef >= 0, "[rl] kl_coef",
                 f"must be finite and >= 0, got {rl.kl_coef}")
        _require(math.isfinite(rl.advantage_eps) and rl.advantage_eps > 0, "[rl] advantage_eps",
                 f"must be finite and > 0, got {rl.advantage_eps}")
        _check_rl_loss(cfg)
        rollout_sequences = gbs * rl.updates_per_rollout
        per_rank = rollout_sequences // dp
        _require(per_rank % rl.samples_per_prompt == 0, "[rl] samples_per_prompt",
                 f"{per_rank} sequences per rank per rollout (global_batch_size x updates_per_rollout / DP) "
                 f"do not split into groups of {rl.samples_per_prompt}")
        _require(rl.max_new_tokens < t.seq_len, "[rl] max_new_tokens",
                 f"{rl.max_new_tokens} leaves no room for a prompt in seq_len {t.seq_len}")
        _require(rl.format_reward >= 0, "[rl] format_reward", f"must be >= 0, got {rl.format_reward}")
        if rl.rollout_source == "file":
            _check_rollout_dir(cfg, args, rollout_sequences, scan_rollout_rows)
        elif rl.rollout_source in ("vllm", "sglang"):
            _check_rollout_engine(cfg)
            _warn_file_sync(cfg, args, world_size)
            if cfg.rl.rollout_source == "vllm" and cfg.rollout_engine.weight_sync == "ipc":
                _check_ipc_world(cfg.rollout_engine, world_size)
        from ..rl.rewards import resolve_reward

        try:
            resolve_reward(rl.reward_fn)
        except ValueError as e:
            raise ConfigError(f"[rl] {e}") from None
    b = cfg.balance
    if b.balancer != "off":
        _require(rl.enable, "[balance] balancer", "run-time placement needs [rl] enable = true (replayed routes)")
        _require(ep > 1, "[balance] balancer", f"run-time placement needs expert_parallel_degree > 1, got {ep}")
        _require(b.spare_slots >= 0, "[balance] spare_slots", f"must be >= 0, got {b.spare_slots}")
        _require(b.owner_policy == "contiguous" or b.balancer == "foremoe", "[balance] owner_policy",
                 f"'balanced' owners are planned by balancer = 'foremoe', not {b.balancer!r}")
        _require(b.owner_hysteresis >= 0, "[balance] owner_hysteresis", f"must be >= 0, got {b.owner_hysteresis}")
        _check_slot_cost(b)
        _require(b.prefetch_window_layers >= 0, "[balance] prefetch_window_layers",
                 f"must be >= 0 (0: no bound), got {b.prefetch_window_layers}")
        _check_balance_bounds(cfg, args, ep)
        rpn = ep_ranks_per_node(b.ranks_per_node, ep, os.environ.get("LOCAL_WORLD_SIZE"))
        _require(b.balancer != "exact" or rpn >= ep, "[balance] balancer",
                 f"'exact' duplicates experts inside one NVLink domain: the EP group ({ep}) spans nodes of {rpn}")
    else:
        rpn = ep
    return Resolved(
        world_size=world_size,
        dp_shard=shard,
        dp_replicate=rep,
        ep=ep,
        dp_degree=dp,
        num_experts=args.num_experts,
        top_k=args.top_k,
        n_layers=args.n_layers,
        micro_steps=gbs // (t.local_batch_size * dp),
        global_batch_size=gbs,
        rollout_sequences=rollout_sequences,
        ranks_per_node=rpn,
    )
