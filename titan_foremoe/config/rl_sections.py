"""The RL sections of the job configuration: ``[rl]``, ``[rollout_engine]`` and ``[sglang_engine]``.

Split from ``job_config.py`` (which re-exports them, so ``from titan_foremoe.config.job_config import RL`` stays
the import); one dataclass per TOML section, the doc string under each field is its reference entry
(``config/reference.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class RL:
    """GRPO post-training: rollout -> recompute -> policy update, every step.

    A step rolls out ``training.global_batch_size x updates_per_rollout``
    sequences (``samples_per_prompt`` per prompt, prompts split over the
    data-parallel ranks), recomputes their log-probs, then takes
    ``updates_per_rollout`` optimizer steps over them in micro-steps of
    ``training.local_batch_size`` sequences per rank.
    """

    enable: bool = False
    """GRPO post-training (else a supervised job)."""
    sft_warmup_steps: int = 0
    """Supervised steps on the task before RL (the debug model starts from random weights)."""
    samples_per_prompt: int = 4
    """Completions sampled per prompt (one GRPO group)."""
    updates_per_rollout: int = 1
    """Optimizer steps taken over each rollout (its sequences split into that many mini-batches)."""
    max_new_tokens: int = 8
    """Longest completion."""
    temperature: float = 1.0
    """Sampling temperature (0: greedy); recompute and update take log-probs at the same temperature."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1: off)."""
    clip_eps: float = 0.2
    """PPO clip range; sets both bounds unless ``clip_eps_low`` / ``clip_eps_high`` is given."""
    clip_eps_low: float | None = None
    """Ratio floor ``1 - clip_eps_low`` (default: ``clip_eps``)."""
    clip_eps_high: float | None = None
    """Ratio ceiling ``1 + clip_eps_high`` (DAPO clip-higher, e.g. 0.28; default: ``clip_eps``)."""
    clip_ratio_c: float = 0.0
    """Dual clip: a negative-advantage token's loss is at most ``-A * clip_ratio_c`` (> 1, e.g. 3). 0: off."""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"] = (
        "token-mean")
    """How token losses become the step's loss, over all micro-steps and ranks (verl's names; docs/rl.md)."""
    loss_norm_tokens: int = 0
    """``seq-mean-token-sum-norm``'s constant divisor (Dr. GRPO). 0: ``max_new_tokens``."""
    kl_coef: float = 0.0
    """Weight of KL(policy || reference); the reference is the policy at the start of RL. 0: off."""
    kl_estimator: Literal["k1", "k2", "k3", "low_var_kl"] = "k3"
    """Per-token KL estimator (Schulman's k1/k2/k3; ``low_var_kl``: verl's clamped k3)."""
    entropy_coef: float = 0.0
    """Entropy bonus: ``entropy_coef * H(policy)`` is subtracted from the loss. 0: off (H is still logged)."""
    logprob_chunk_tokens: int = 1024
    """Log-probs and entropy are computed this many tokens at a time (memory O(chunk x vocab))."""
    recompute_merge: int = 1
    """The recompute stage runs this many consecutive update micro-steps of a rank as ONE forward (verl's
    ``log_prob_micro_batch_size_per_gpu`` above ``ppo_micro_batch_size_per_gpu``): no activations are kept for a
    backward, so it can run larger micro-steps than the update; fewer, larger forwards pay the per-micro-step
    fixed costs (the placement's plan, moves and checks, the kernels' launches) fewer times and give the planner
    larger expert groups. Memory: the forward's transient buffers grow with the merged tokens (the MoE dispatch,
    ``top_k`` x tokens x dim; the log-probs stay ``logprob_chunk_tokens`` at a time). Needs packed rows
    (``[training] pack_sequences``). 1: the update's micro-steps (docs/rl.md, "The recompute's micro-steps")."""
    rollout_is: Literal["off", "token", "sequence"] = "off"
    """Rollout correction: importance weights ``pi_recompute / pi_rollout`` per token or per sequence on the
    policy-gradient term (needs rollouts with log-probs)."""
    rollout_is_threshold: float = 2.0
    """Upper bound of a rollout-correction weight (> 0)."""
    rollout_is_mode: Literal["truncate", "mask"] = "truncate"
    """A weight above the threshold is cut to it (``truncate``) or zeroes its token / sequence (``mask``)."""
    router_replay: bool = True
    """Recompute and update use the rollout's experts (the gate stays differentiable); ``false`` needs
    ``[balance] balancer = "off"`` (a plan is made for the rollout's routes)."""
    reward_fn: str = "task"
    """``task``, ``exact_match``, ``math`` (math-verify: the completion's final answer equals the reference)
    or ``package.module:function(task, example, completion) -> float``."""
    bad_reward: Literal["stop", "zero"] = "stop"
    """A reward that is not a finite number (NaN, inf, None, a string): ``stop`` the job before that step's update,
    naming the reward function, the row and the value; or ``zero``: score it 0, count it (``rl/bad_rewards``)
    and say so on rank 0."""
    advantage_eps: float = 1e-6
    """Added to a group's reward standard deviation before dividing by it."""
    advantage_std_norm: bool = True
    """Divide advantages by the group's reward std (GRPO); false: Dr. GRPO."""
    advantage_baseline: Literal["mean", "leave_one_out"] = "mean"
    """Group mean (GRPO) or the mean of the other samples of the group (RLOO)."""
    filter_groups: bool = False
    """DAPO dynamic sampling: a group whose rewards are all equal leaves the loss (its tokens are still replayed;
    counted as ``rl/groups_filtered``). The batch is refilled only with ``filter_groups_max_rounds``."""
    filter_groups_max_rounds: int = 0
    """DAPO refill (embedded rollouts): up to this many extra rounds of fresh prompts per step put informative
    groups in uniform groups' places (``rl/refill_rounds``, ``rl/groups_refilled``, ``rl/groups_unfilled``);
    each round costs one rollout of the most groups any rank lacks. 0: no refill."""
    overlong_filter: bool = False
    """A completion that hit ``max_new_tokens`` without an end token leaves the loss (``rl/overlong_filtered``)."""
    overlong_buffer: int = 0
    """DAPO soft overlong punishment: the reward falls linearly by up to ``overlong_penalty`` over the last
    ``overlong_buffer`` tokens before ``max_new_tokens``. 0: off."""
    overlong_penalty: float = 1.0
    """The largest soft overlong punishment (DAPO's penalty factor)."""
    save_loads: bool = False
    """Write each step's ``loads_MLSE`` to ``dump_folder/loads/step_XXXXX.pt`` (counted from 0 over the whole job,
    as ``dump_rollouts``: ``step_00001.pt`` is the log's ``step 2``)."""
    rollout_source: Literal["embedded", "file", "vllm", "sglang"] = "embedded"
    """``embedded``: generate on the policy; ``file``: read each step's rollouts from ``rollout_dir``; ``vllm``: a
    live vLLM engine generates them from the policy's current weights (``[rollout_engine]``, docs/rollouts_vllm.md);
    ``sglang``: a live SGLang engine does (``[sglang_engine]``, docs/rollouts_sglang.md)."""
    rollout_dir: str = ""
    """A rollout directory written by ``python -m titan_foremoe.rollouts import`` (file mode)."""
    rollout_overlong: Literal["refuse", "truncate"] = "refuse"
    """File mode: a sequence with more than ``seq_len`` input tokens is refused, or cut (and counted)."""
    format_reward: float = 0.0
    """Added to the reward of a completion whose final answer is in ``\\boxed{}`` (0: off)."""
    dump_rollouts: bool = False
    """Write every step's sequences to ``dump_folder/rollouts/step_XXXXX.jsonl`` (prompt_ids, completion_ids,
    prompt, completion, reward, answer; with the vLLM source also ``weights_version``), named by the step that
    trains on them, counted from 0 over the whole job (SFT warm-up included): ``step_00001.jsonl`` holds the
    rollouts of the log's ``step 2`` and checkpoint ``step-2`` (the rows' ``step`` field is the same number)."""
    sequence_schedule: Literal["balanced", "rollout_order"] = "balanced"
    """Where each sequence of a step runs: ``balanced`` puts every sequence on a (rank, micro-step) right after the
    rollout so that each micro-step's dense cost (tokens and causal attention pairs) is level over the ranks
    (sequences move between ranks: one host exchange per step; docs/schedule.md); ``rollout_order`` keeps each
    rank's own rows, dealt in rollout order (the baseline). Neither changes the loss: mini-batches keep their
    sequences and the normalizers are global."""
    max_staleness: int = 0
    """Asynchronous RL (``rollout_source = "vllm"``): 0 trains each step on rollouts of its own weights (the
    synchronous loop); k >= 1: the engines generate the rollouts of steps up to N+k while step N trains, each
    row from weights at most k steps older than its step (off-policy, corrected by ``rollout_is``); an engine
    reloads between requests, when none of its requests is running, while the others keep generating; step N+1
    is planned before it starts. At most 4. A rollout whose weights are more than k steps old is handled by
    ``stale_rollouts``. docs/rl.md, Asynchronous RL."""
    take_first_finished: bool = False
    """With ``max_staleness`` > 0 (live vLLM engines): step N trains on the first finished prompt groups of every
    started step's requests (oldest step first among the finished ones, as many groups per rank as a step
    holds) instead of waiting for all of step N's own; groups not taken stay for later steps, one whose weights
    are more than ``max_staleness`` steps old when taken is dropped (``rollout/dropped_stale``). docs/rl.md,
    Taking the first finished groups."""
    plan_from_stream: bool = False
    """With ``max_staleness`` > 0: the next step's sequence schedule, foresight loads and placement plans are made
    at the first point of the current step where its rows are complete on every rank (after the recompute stage,
    then after each update mini-batch: a non-blocking poll at each) instead of after the update stage (still the
    fallback, blocking). Losses are the same; metric ``foresight/prepared_at``. Not with balanced owners.
    docs/rl.md, Plans from the stream."""
    stale_rollouts: Literal["error", "regenerate"] = "error"
    """A rollout older than ``max_staleness`` (e.g. a checkpoint's in-flight rollout resumed with a smaller
    ``max_staleness``): stop naming it, or generate the step again from the current weights."""
    rollout_token_budget: float = 0.0
    """Partial rollouts (``rollout_source = "vllm"``, synchronous): a step's generation stops once enough of this
    rank's groups (a prompt's ``samples_per_prompt`` responses) have finished: ``0 < x <= 1`` the fraction of the
    groups, ``x > 1`` the tokens of the finished groups' responses; the engines abort the rest, which keep their
    tokens, per-token behaviour log-probs, routes and weights versions and continue in the next steps under the
    new weights. Only finished groups train. 0: off (every response finishes in its step). docs/rl.md, Partial
    rollouts."""
    rollout_chunk_tokens: int = 256
    """Partial rollouts: each response is requested in chunks of this many tokens (prompt + what it has re-sent,
    its KV from the engine's prefix cache), the budget checked between chunks; a running chunk is aborted once the
    budget is met (vLLM 0.28 answers an aborted request with none of its tokens, so a chunk bounds what is lost).
    0: one request per response (the abort alone stops it)."""
    partial_max_staleness: int = 1
    """Partial rollouts: a response whose oldest token was sampled more than this many steps before the step that
    would train it is dropped (counted in ``rollout/dropped_stale``)."""


@dataclass(kw_only=True)
class RolloutEngine:
    """The vLLM engine of ``[rl] rollout_source = "vllm"``: launched by the trainer or run by the user.

    Every RL step the engine first gets the policy's weights (an HF folder every rank writes its slices of, then a
    reload or a restart and a prefix-cache reset), a probe checks its log-probs equal the trainer's, then each
    data-parallel rank sends its own prompts (token ids in, token ids, log-probs and routed experts out).
    """

    python: str = ""
    """The engine venv's interpreter (``scripts/setup_vllm_cpu.sh`` prints it); needed with ``launch``."""
    url: str = ""
    """An engine the user runs (``http://host:port``, vLLM 0.28 to 0.33, started with its version's routed-experts
    flags, ``--logprobs-mode processed_logprobs`` and ``VLLM_SERVER_DEV_MODE=1``: docs/rollouts_vllm.md); empty:
    ``launch`` one."""
    launch: bool = True
    """Start ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 and a free port, own its lifetime
    (stopped on exit or failure, restarted up to ``max_restarts`` times if it dies)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The engine's dtype, and that of the weight folders written for it."""
    max_model_len: int = 1024
    """The engine's context length (>= the longest prompt + ``[rl] max_new_tokens``)."""
    extra_args: list[str] = field(default_factory=list)
    """More engine arguments, e.g. ``["--max-num-batched-tokens", "4096"]``."""
    weight_sync: Literal["reload", "restart", "nccl", "ipc"] = "reload"
    """How new weights reach the engine: ``reload_weights`` in place from an HF folder (on CPU with
    vllm_cpu_patches' fix of the MoE experts), a fresh launched engine on the new folder (slower: an engine start;
    a user-run engine reloads instead), ``nccl`` (GPU only): vLLM's packed weight transfer, trainer rank 0
    gathering each bucket once and broadcasting it, the other GPUs of its node relaying, no folder after the
    launch, or ``ipc`` (a colocated engine: its workers on the GPUs of rank 0's node): vLLM's packed IPC transfer,
    each bucket gathered to rank 0, broadcast over its node and handed over as one CUDA IPC handle per GPU
    (docs/rollouts_vllm.md). ``reload`` above one node moves the whole policy through the file system every
    step (the config check warns). Several engines: ``reload`` has each reload the same folder; ``nccl`` puts
    every engine's workers in ONE transfer group after rank 0 and its node's relays (engine k at rank offset
    1 + relays + k x gpus_per_engine), each bucket broadcast once for all, the group made again over the
    survivors when an engine dies; ``ipc`` feeds colocated engines from their own nodes."""
    nccl_address: str = "127.0.0.1"
    """``weight_sync = "nccl"``: the address of trainer rank 0's host that the engine's workers connect to (the
    transfer group's rendezvous); 127.0.0.1 only when the engine runs on rank 0's node."""
    engines: int = 1
    """Launched engines (``launch``; each on its own port, log ``engine_<k>.log`` beside the weight folders,
    started by rank 0, or with ``colocated`` by the first rank of its GPUs); the step's requests are dealt over
    them by outstanding tokens, a prompt's samples on one engine (docs/rollouts_vllm.md, The engine fleet).
    0: one per ``gpus_per_engine`` GPUs of the job when ``colocated``, else one."""
    gpus_per_engine: int = 1
    """Each engine's GPUs (its workers: tensor x pipeline x data parallel). ``weight_sync = "nccl"``: the transfer
    group is trainer rank 0, the other ranks of its node (relays), then these (a fleet: every engine's, one
    after another, in one group); ``ipc``: at most the
    GPUs of rank 0's node (the workers run there). Replaces ``engine_workers``."""
    urls: list[str] = field(default_factory=list)
    """Engines the user runs (each as ``url`` says), one fleet slot each; empty: ``url``, or ``engines``
    launched. ``url`` and ``urls`` together are refused."""
    colocated: bool = False
    """The engines share the trainer's GPUs (each inside one node, fed by its own node's ranks): the fleet's
    layout (``rollouts/fleet/layout.py``); false: GPUs of their own."""
    weight_sync_bucket_mb: int = 512
    """``weight_sync = "nccl"`` / ``"ipc"``: the HF tensors travel packed in buckets of this many MiB (vLLM's
    ``packed`` transfer), one broadcast (``ipc``: one ``/update_weights``) per bucket instead of one per tensor;
    trainer rank 0 holds one bucket's tensors and their packed copy beyond its shard, with ``ipc`` every other GPU
    of its node one bucket (docs/rollouts_vllm.md)."""
    fused_expert_load: bool = True
    """``weight_sync = "nccl"`` / ``"ipc"``: each MoE layer's experts travel stacked under vLLM's fused names (``gate_up_proj``
    ``[E, 2F, D]``, ``down_proj`` ``[E, D, F]``) and our worker extension loads them with 3 loader calls per layer
    (~0.44 s per Qwen3-30B-A3B sync per worker, vLLM's per-expert load ~3.3-4 s: docs/rollouts_vllm.md). A
    launched engine gets ``--worker-extension-cls`` itself; a user-run engine must be started with it. false: one
    HF tensor per expert (vLLM's own loader)."""
    weights_dir: str = ""
    """Where the per-step HF folders are written (two, alternating); empty: ``dump_folder/engine_weights``.
    Must be readable by the engine (a shared file system when it runs on other nodes)."""
    probe_tolerance: float = 1e-4
    """Largest |engine - trainer| log-prob of the probe sequence after a weight sync (fp32: ~1e-6 measured)."""
    sleep_level: int = 0
    """A colocated engine (``weight_sync = "ipc"``) asleep while the trainer trains (vLLM's sleep mode, CUDA / ROCm
    only; launched with ``--enable-sleep-mode``): 0 off; 1 its weights offloaded to pinned host memory and its KV
    cache dropped (host memory: the engine's weights per node, ``scripts/dry_run.py`` states it); 2 both dropped
    (no host memory; the weights are undefined after the wake, so every sync sends them whole, as ours do).
    Each step wakes the weights, syncs, then wakes the KV cache (``rollouts/fleet/sleep.py``); the trainer plans
    the step (its recompute's first plan among it) while the engines fall asleep after the rollout. Refused on CPU,
    with engines on GPUs of their own and with ``[rl] max_staleness`` > 0. A user-run engine must be started with
    ``--enable-sleep-mode``."""
    startup_timeout_s: float = 600.0
    """Seconds a launched engine may take to become healthy."""
    request_timeout_s: float = 300.0
    """Seconds one generate request may take."""
    hang_timeout_s: float = 60.0
    """An engine whose token counters (``/metrics``: generated + prompt tokens) did not move for this many seconds
    while a rank had samples outstanding on it, or whose ``/metrics`` did not answer that long, is hung (a wedged
    GPU or scheduler, a stopped process; vLLM's ``/health`` still answers while its engine core is wedged): its
    unanswered requests go to the other engines, a launched one is killed and restarted in the background, a
    user-run one stays out of the deal until it moves again (``rollouts/fleet/hang.py``: each rank polls only the
    engines it waits on, every min(5 s, hang_timeout_s / 4)). 0: off (only ``request_timeout_s`` ends a hung
    request). Below ``request_timeout_s``."""
    retries: int = 2
    """Retries of a request that got no answer (a refused request is an error at once)."""
    max_restarts: int = 1
    """Restarts of a launched engine that died or hung, over the whole job (then the job stops with the engine's
    log)."""
    concurrency: int = 8
    """Generate requests in flight per data-parallel rank (one request = one sample; a prompt's ``samples_per_prompt``
    samples are separate requests)."""


@dataclass(kw_only=True)
class SGLangEngine:
    """The SGLang engine of ``[rl] rollout_source = "sglang"``: launched by the trainer or run by the user.

    The keys mean what ``[rollout_engine]``'s do. Every RL step the engine gets the policy's weights (an HF folder
    every rank writes its slices of, then ``/update_weights_from_disk`` and ``/flush_cache``, or a restart), a
    probe checks its log-probs equal the trainer's, then each data-parallel rank sends its own prompts
    (``/generate``: token ids in, token ids, log-probs and routed experts out).
    """

    python: str = ""
    """An interpreter with SGLang installed; needed with ``launch``."""
    url: str = ""
    """An engine the user runs (``http://host:port``, started with ``--enable-return-routed-experts`` and
    ``--skip-tokenizer-init``); empty: ``launch`` one."""
    launch: bool = True
    """Start ``python -m sglang.launch_server`` on 127.0.0.1 and a free port, own its lifetime (stopped on exit
    or failure, restarted up to ``max_restarts`` times if it dies)."""
    dtype: Literal["float32", "bfloat16"] = "float32"
    """The engine's dtype, and that of the weight folders written for it."""
    max_model_len: int = 1024
    """The engine's context length (``--context-length``; >= the longest prompt + ``[rl] max_new_tokens``)."""
    extra_args: list[str] = field(default_factory=list)
    """More engine arguments, e.g. ``["--device", "cpu"]`` or ``["--enable-deterministic-inference"]`` (which
    makes SGLang honour each sample's ``sampling_seed``)."""
    weight_sync: Literal["disk", "restart", "distributed"] = "disk"
    """How new weights reach the engine: ``/update_weights_from_disk`` in place from an HF folder, then
    ``/flush_cache``; a fresh launched engine on the new folder (a user-run engine loads from disk instead); or
    ``distributed`` (GPU only): trainer rank 0 gathers them in buckets and broadcasts each to the engine's workers,
    the other GPUs of its node relaying (``/init_weights_update_group`` once, ``/update_weights_from_distributed``
    per bucket), no folder after the launch."""
    nccl_address: str = "127.0.0.1"
    """``weight_sync = "distributed"``: the address of trainer rank 0's host the engine's workers connect to (a
    sender group's source on another node hosts its group on its own address on the route to the engine)."""
    engines: int = 1
    """Launched engines (``[rollout_engine] engines``). SGLang runs one server per job here: more is refused in
    one line (docs/rollouts_sglang.md, Several servers)."""
    gpus_per_engine: int = 1
    """The engine's GPUs (its tensor-parallel size); ``weight_sync = "distributed"``: the group is trainer rank
    0, the other ranks of its node (relays), then these. Replaces ``engine_workers``."""
    urls: list[str] = field(default_factory=list)
    """Servers the user runs; at most one here (as ``engines``)."""
    colocated: bool = False
    """The server shares the trainer's GPUs (``[rollout_engine] colocated``)."""
    weight_sync_bucket_mb: int = 512
    """``weight_sync = "distributed"``: the HF tensors travel in buckets of this many MiB, one
    ``/update_weights_from_distributed`` (``load_format = "flattened_bucket"``: one broadcast) per bucket
    (docs/rollouts_sglang.md)."""
    weight_sync_senders: int = 4
    """``weight_sync = "distributed"``: sender groups, each a source trainer rank and the next GPUs of its node
    (up to ``world / senders``) as relays, in an update group of its own on the engine; buckets are dealt to the
    sources in turn, so a rank sends and receives ~model / senders, not the model. The engine takes one group's
    update at a time and its workers hold one NCCL communicator per group (~0.25 GB each): more senders, a smaller
    share per rank but narrower groups (a group's broadcast leaves its node on one NIC per member) and more engine
    memory; 4 keeps Qwen3-30B-A3B's sync under 1 s from 16 GPUs up (docs/rollouts_sglang.md)."""
    weights_dir: str = ""
    """Where the per-step HF folders are written (two, alternating); empty: ``dump_folder/engine_weights``.
    Must be readable by the engine (a shared file system when it runs on other nodes)."""
    probe_tolerance: float = 1e-4
    """Largest |engine - trainer| log-prob of the probe sequence after a weight sync."""
    startup_timeout_s: float = 600.0
    """Seconds a launched engine may take to become healthy."""
    request_timeout_s: float = 300.0
    """Seconds one generate request may take."""
    retries: int = 2
    """Retries of a request that got no answer (a refused request is an error at once)."""
    max_restarts: int = 1
    """Restarts of a launched engine that died, over the whole job (then the job stops with the engine's log)."""
    concurrency: int = 8
    """Generate requests in flight per data-parallel rank (one request = one sample)."""
