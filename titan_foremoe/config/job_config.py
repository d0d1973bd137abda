"""The job configuration, one dataclass per TOML section.

Key names follow torchtitan's (``training.local_batch_size``,
``parallelism.expert_parallel_degree``, ``lr_scheduler.warmup_steps``...), so a
torchtitan user finds them where they expect. ``training.local_batch_size`` is
the number of sequences one data-parallel rank runs in one micro-step;
``training.global_batch_size`` the sequences of one optimizer step over all
ranks; their ratio gives the gradient-accumulation micro-steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class Job:
    name: str = "titan_foremoe"
    """Name of the job, shown in logs and the run summary."""
    dump_folder: str = "./outputs"
    """Folder for TensorBoard events, checkpoints and run summaries."""
    seed: int = 0
    """Seed of model initialisation, data order and rollout sampling."""
    deterministic: bool = False
    """Ask torch for deterministic algorithms (slower; for bit-exact reruns)."""
    description: str = ""
    """Free text kept in the run summary."""


@dataclass(kw_only=True)
class Model:
    flavor: Literal["debug_tiny", "qwen3_30b_a3b", "gpt_oss_20b"] = "debug_tiny"
    """A named model size (``titan_foremoe/models/flavors.py``); unused with ``hf_assets_path``."""
    expert_dtype: Literal["bfloat16", "float32"] = "bfloat16"
    """Compute dtype of the grouped expert matmuls (parameters stay fp32)."""
    n_layers: int | None = None
    """Override of the flavor's number of transformer blocks (every block has a MoE layer)."""
    dim: int | None = None
    """Override of the flavor's model dimension."""
    num_experts: int | None = None
    """Override of the flavor's routed experts per MoE layer (must divide by the EP degree)."""
    top_k: int | None = None
    """Override of the flavor's experts per token."""
    moe_hidden_dim: int | None = None
    """Override of the flavor's expert FFN hidden size."""
    shared_expert_hidden_dim: int | None = None
    """Override of the shared expert's hidden size (> 0 adds a shared expert)."""
    load_balance_coeff: float | None = None
    """Aux-loss-free bias balancing (torchtitan's hook); off for replayed RL."""
    hf_assets_path: str = ""
    """A Hugging Face Qwen3-MoE folder: the model shape comes from its ``config.json`` (``flavor`` is not
    used) and the tokenizer (with its chat template) from its tokenizer files. Weights load from it with
    ``[checkpoint] enable = true`` and ``initial_load_in_hf = true`` (torchtitan's names)."""


@dataclass(kw_only=True)
class Optimizer:
    name: Literal["AdamW", "Adam"] = "AdamW"
    """torchtitan's ``OptimizersContainer`` optimizer."""
    lr: float = 3e-3
    """Peak learning rate (0 is legal: evaluation and export runs)."""
    beta1: float = 0.9
    """First-moment decay, in [0, 1)."""
    beta2: float = 0.95
    """Second-moment decay, in [0, 1)."""
    eps: float = 1e-8
    """Adam's epsilon (> 0)."""
    weight_decay: float = 0.0
    """Decoupled weight decay (>= 0)."""


@dataclass(kw_only=True)
class LRScheduler:
    warmup_steps: int = 2
    """Linear warm-up steps (torchtitan's ``LRSchedulersContainer``)."""
    decay_ratio: float | None = None
    """Fraction of the steps spent decaying at the end (unset: decay after the warm-up)."""
    decay_type: Literal["linear", "sqrt", "cosine"] = "linear"
    """Shape of the decay."""
    min_lr_factor: float = 0.1
    """The decay ends at this fraction of ``lr``, in [0, 1]."""


@dataclass(kw_only=True)
class Training:
    steps: int = 30
    """Optimizer steps of a supervised job; RL jobs take ``rl.sft_warmup_steps`` + steps x ``rl.updates_per_rollout``."""
    local_batch_size: int = 4
    """Sequences per data-parallel rank in one micro-step."""
    global_batch_size: int = -1
    """Sequences per optimizer step over all ranks; -1: one micro-step."""
    seq_len: int = 64
    """Tokens per training sequence (RL: prompt + completion inputs)."""
    max_norm: float = 1.0
    """Gradient-norm clipping threshold."""
    mixed_precision_param: Literal["bfloat16", "float32"] = "float32"
    """FSDP's compute dtype for parameters (``bfloat16`` on GPUs)."""
    nonfinite: Literal["stop", "skip"] = "stop"
    """A non-finite loss or gradient norm: ``stop`` the job before the optimizer step (no checkpoint of the
    poisoned state), or ``skip`` that update (gradients dropped, LR schedule not advanced) and go on."""
    nonfinite_max_skips: int = 5
    """With ``nonfinite = "skip"``: stop the job after this many updates skipped in a row (the model has stopped
    training); 0: no bound."""
    pack_sequences: bool = True
    """RL recompute and update: each micro-step's sequences concatenated into one row (positions restart per
    sequence, attention within each sequence: varlen attention on CUDA in bf16, a block-diagonal causal mask
    elsewhere), so no padded position is computed; ``false``: one right-padded row per sequence (the baseline)."""
    max_tokens_per_micro_step: int = 0
    """RL: a token budget per rank per micro-step (verl's ``ppo_max_token_len_per_gpu``): micro-steps are formed by
    it, not by ``local_batch_size`` rows, and every rank runs the same number per stage (agreed from the step's
    sequence schedule). Must be >= ``seq_len`` (a sequence always fits). 0: each optimizer step keeps the
    micro-steps of ``global_batch_size / (local_batch_size x DP)``."""


@dataclass(kw_only=True)
class Parallelism:
    data_parallel_shard_degree: int = -1
    """FSDP shard degree (-1: the rest of the world size)."""
    data_parallel_replicate_degree: int = 1
    """HSDP replicas (1: plain FSDP)."""
    expert_parallel_degree: int = 1
    """EP degree, borrowed from dp_shard (any divisor of it); experts are FSDP-sharded over ``efsdp`` = dp_shard / EP."""
    fsdp_reshard_after_forward: Literal["default", "always", "never"] = "default"
    """torchtitan's FSDP reshard policy (``never`` keeps blocks unsharded from forward to backward)."""


@dataclass(kw_only=True)
class Compile:
    enable: bool = False
    """``torch.compile`` the model (needs ``[model] expert_dtype = "bfloat16"``)."""
    backend: str = "inductor"
    """``torch.compile`` backend."""


@dataclass(kw_only=True)
class ActivationCheckpoint:
    """torchtitan's activation checkpointing of every transformer block (``distributed/activation_checkpoint.py``),
    with the MoE seams (token mask, logged routes, placement) replayed in the recompute (RL and SFT)."""

    mode: Literal["none", "full", "selective"] = "none"
    """``full``: keep only each block's input, recompute the block in backward (re-runs the dispatch and combine
    all-to-alls; ~1/3 more compute). ``selective``: torchtitan's per-op policy (keeps matmul / attention /
    all-to-all outputs, recomputes every second matmul and the rest). ``none``: keep every activation."""
    preserve_rng_state: bool = True
    """Stash and restore the RNG state around each recompute (torchtitan's default; the models here draw no
    random numbers in a training forward, so ``false`` only saves the stash)."""
    determinism_check: Literal["default", "none"] = "default"
    """torch.utils.checkpoint's check that the recompute saves tensors of the forward's shapes and dtypes
    (``none`` skips it)."""


@dataclass(kw_only=True)
class Metrics:
    log_freq: int = 1
    """Print a progress line every this many steps (and at the first and last)."""
    enable_tensorboard: bool = True
    """Write TensorBoard events under ``dump_folder/save_tb_folder``."""
    save_tb_folder: str = "tb"
    """TensorBoard folder inside ``dump_folder``."""
    tokens_per_expert: bool = True
    """Write one scalar per (layer, expert) for every micro-step."""


@dataclass(kw_only=True)
class Checkpoint:
    enable: bool = False
    """torchtitan's ``CheckpointManager`` (DCP); a job resumes from the latest complete checkpoint."""
    folder: str = "checkpoint"
    """Checkpoint folder inside ``dump_folder``."""
    interval: int = 50
    """Save every this many steps (and at the last step)."""
    keep_latest_k: int = 2
    """Checkpoints kept (0: all); torchtitan refuses 1: with async saves the newest may still be in flight."""
    last_save_model_only: bool = False
    """The final checkpoint holds model weights only (an export): the job can then not be extended."""
    initial_load_path: str = ""
    """Checkpoint loaded when ``folder`` has none; with ``initial_load_in_hf`` an HF folder
    (empty: ``[model] hf_assets_path``). Relative paths are taken from the working directory."""
    initial_load_in_hf: bool = False
    """The initial checkpoint is HF safetensors (read shard by shard: each rank reads only what it owns)."""
    last_save_in_hf: bool = False
    """The final checkpoint (and an ``hf/`` copy in every interval checkpoint) is an HF folder that
    transformers loads; needs ``last_save_model_only = true`` and ``[model] hf_assets_path``."""
    export_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """dtype of a model-only final checkpoint."""
    load_step: int = -1
    """Resume from this ``step-N`` instead of the newest complete one (-1); the pre-flight names one
    when the newest cannot serve the job (another model size, a missing or truncated shard)."""
    verify: Literal["sample", "full", "off"] = "sample"
    """How the pre-flight checks the step it will load against the checksums its save recorded: "sample" reads
    4 x 256 KiB of every file (a zeroed, truncated or replaced shard; 64 MiB on 64 ranks), "full" streams every
    file (61 GB at Qwen3-30B-A3B: ~45 s per 1.4 GB/s core), "off" skips it. A failed load is always checked in full."""
    save_on_signal: bool = False
    """SIGTERM / SIGINT (a scheduler's grace period): the workers finish the current step, save it, then stop
    (one all-reduce per step); false: they stop at once. torchrun's agent, when signalled itself, waits 30 s for
    its workers before SIGKILL: a longer step loses the save (the last complete checkpoint stays)."""


@dataclass(kw_only=True)
class Comm:
    init_timeout_seconds: int = 300
    """Timeout of collectives until the first training step ends (start-up, loading)."""
    train_timeout_seconds: int = 120
    """Timeout of collectives from step 2 on; the watchdog reports a phase stalled for half of it."""
    join_timeout_seconds: int = 300
    """Time the nodes that started wait for the others to join torchrun's rendezvous (``run_train.sh`` with
    ``NNODES`` > 1); then they stop with one line naming the ``node_rank``s that never arrived (a node whose
    pre-flight failed exits before it joins). torchrun's own default is 600 s, without a word."""
    trace_buf_size: int = 20000
    """NCCL flight recorder entries per rank (torchtitan's default); on a collective timeout every rank dumps its
    last collectives to ``<dump_folder>/comm_traces/``. 0 switches the recorder off."""
    # "fake_backend": torchtitan's dry-run mode, collectives are no-ops (NGPU and RANK from the environment)
    mode: Literal["default", "fake_backend"] = "default"


@dataclass(kw_only=True)
class Data:
    task: Literal["sort_digits", "add_digits"] = "sort_digits"
    """The embedded verifiable task when ``path`` is empty."""
    min_digits: int = 3
    """Shortest digit string of the embedded task."""
    max_digits: int = 6
    """Longest digit string of the embedded task."""
    path: str = ""
    """A JSONL or Parquet file of prompts with reference answers (replaces ``task``; needs
    ``[model] hf_assets_path`` for the tokenizer and chat template)."""
    prompt_key: str = "prompt"
    """Field of a ``path`` row holding the prompt."""
    answer_key: str = "answer"
    """Field of a ``path`` row holding the reference answer."""
    chat_template: str = ""
    """Prompts go through the tokenizer's chat template ("": an error when it has none), none ("none"),
    or the Jinja template in this file."""
    system_prompt: str = ""
    """System message put before every prompt by the chat template (empty: none)."""
    response_template: str = "{answer}"
    """Supervised warm-up target, formatted with the row's answer (e.g. ``\\boxed{{{answer}}}``)."""
    shuffle: bool = True
    """Seeded (``[job] seed``) reshuffle every epoch."""
    skip_bad_rows: bool = False
    """Skip (and count) rows with a missing key, an empty prompt or a prompt longer than the context,
    instead of refusing the file."""


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
    Each step wakes the weights, syncs, then wakes the KV cache (``rollouts/fleet/sleep.py``). Refused on CPU,
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


@dataclass(kw_only=True)
class Balance:
    """Run-time expert placement for the recompute and update stages (RL only)."""

    balancer: Literal["off", "static", "eplb_history", "eplb_oracle", "step_lpt", "foremoe", "reactive", "exact"] = "off"
    """``off``: torchtitan's all-to-all to the owners; the others run through the placement runtime
    (``step_lpt``: one placement per optimizer step from the step's replayed loads, per-layer LPT copies in the
    spare slots, copied at the step boundary, a RoutePack-style baseline, ``planner/step_lpt.py``; ``reactive``: each layer plans and moves inside its own forward, ``placement/reactive.py``; ``exact``:
    MoonEP-style exact quotas planned on the device in each layer, EP group inside one node, ``placement/exact.py``)."""
    spare_slots: int = 1
    """Replica slots per rank on top of its E/EP owned experts (every balancer gets the same); at most
    E - E/EP (a rank never needs more slots than experts)."""
    ranks_per_node: int = 0
    """EP ranks per node for the planner's topology; 0: from torchrun's ``LOCAL_WORLD_SIZE`` (processes per node),
    all EP ranks on one node without it."""
    transfer_path: Literal["direct", "host", "auto"] = "auto"
    """Replica moves over the collective backend, through host staging (CPU-assisted), or per move by the cost model."""
    owner_policy: Literal["contiguous", "balanced"] = "contiguous"
    """Which EP rank owns each expert (weights and optimizer state): ``contiguous`` keeps torchtitan's layout
    (rank r owns experts [r*E/EP, (r+1)*E/EP)); ``balanced`` (foremoe only) re-places owners at optimizer
    steps from the step's foreseen load, moving the weights and AdamW moments (``relayout/*`` metrics)."""
    owner_hysteresis: float = 0.2
    """Balanced owners move only when that lowers the layer's max owner load by more than this x the mean."""
    slot_overhead_tokens: Literal["auto"] | int = "auto"
    """foremoe's cost of one more expert group on a rank, in tokens (a grouped GEMM's per-group fixed time over the
    time of one token): with > 0 the planner balances tokens + this per slot it runs and hands whole experts to
    spare slots before splitting any (``planner/handoff.py``). ``"auto"``: the calibrated cost the cluster
    simulator charges (``simulator.grouped_mm.slot_tokens`` on ``slot_cost_device``'s measured expert model, at the
    model's dim and expert hidden size and the step's mean tokens per expert; per stage: the recompute runs forward
    only, the update forward + backward), computed each RL step from the foreseen loads and logged as
    ``foresight/slot_overhead_tokens_recompute`` / ``_update`` (H100 at the simulator's 64-GPU setting: gpt-oss-20b
    ~65 / ~103, Qwen3-30B-A3B ~344 / ~251; ``summary.json``'s ``planner_slot_tokens``); with it the same model's
    time of one group per row count, on which the last token polish levels the ranks' time
    (``planner/time_polish.py``: ~2x the planning time, off the critical path). An int >= 0: that many
    tokens for both stages; 0: token counts (no handoffs). With a cost the planner takes ~4-6x longer (handoffs
    are searched; docs/simulator.md)."""
    pass_polish: bool = False
    """foremoe with ``slot_overhead_tokens = "auto"``: the update stage's last polish lowers each layer's forward
    and backward maxima over ranks apart (each pass waits for its own slowest rank), on the same model's forward and
    backward tables (``planner/time_polish.py``, ``level_passes``). Off by default: 1.5x (EP 8) / 1.34x (EP 64) the
    update stage's planning time for 0.04-0.06% of the trainer's stages on the simulator at 64 GPUs
    (docs/simulator.md, levers)."""
    slot_cost_device: Literal["h100", "h200"] = "h100"
    """The measured calibration (``calibrations/``) that prices a slot when ``slot_overhead_tokens = "auto"``: the
    planner's cost is data, the same whatever device the job runs on (a CPU run plans as that GPU would)."""
    planner: Literal["thread", "process"] = "thread"
    """Where the update stage is planned while the recompute stage runs: a thread of the training process
    (shares its GIL) or one spawned worker process (``benchmarks/bench_planner_gil.py``, ``docs/guards.md``)."""
    prefetch_window_layers: int = 4
    """Layers whose next-micro-step transfers may be in flight at once (their send and receive buffers alive):
    issuing layer l lands layer l - window first. 0: no bound (every layer's, all through the micro-step).
    4 covers a transfer (2 rows of 9.4 MB: ~0.4 ms at 50 GB/s) with 4 layer forwards (ms each at Qwen3-30B-A3B)
    and bounds the buffers to 4 layers' rows (~0.15 GB per rank) instead of 48 (docs/memory.md)."""


@dataclass(kw_only=True)
class Debug:
    """Checks for what CPU runs cannot otherwise see (``docs/gpu.md``)."""

    check_streams: bool = False
    """CPU only: run the CUDA path's streams, events, ``record_stream``, pinned uploads and collectives on
    emulated streams checked by torch's CUDA sanitizer analysis (``distributed/checked.py``), and raise on any
    host read of a device tensor inside a stage's micro-steps (strict mode). A debug mode: tens of µs per op."""


@dataclass(kw_only=True)
class JobConfig:
    job: Job = field(default_factory=Job)
    model: Model = field(default_factory=Model)
    optimizer: Optimizer = field(default_factory=Optimizer)
    lr_scheduler: LRScheduler = field(default_factory=LRScheduler)
    training: Training = field(default_factory=Training)
    parallelism: Parallelism = field(default_factory=Parallelism)
    compile: Compile = field(default_factory=Compile)
    activation_checkpoint: ActivationCheckpoint = field(default_factory=ActivationCheckpoint)
    metrics: Metrics = field(default_factory=Metrics)
    checkpoint: Checkpoint = field(default_factory=Checkpoint)
    comm: Comm = field(default_factory=Comm)
    data: Data = field(default_factory=Data)
    rl: RL = field(default_factory=RL)
    rollout_engine: RolloutEngine = field(default_factory=RolloutEngine)
    sglang_engine: SGLangEngine = field(default_factory=SGLangEngine)
    balance: Balance = field(default_factory=Balance)
    debug: Debug = field(default_factory=Debug)
