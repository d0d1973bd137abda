"""The job configuration, one dataclass per TOML section.

Key names follow torchtitan's (``training.local_batch_size``,
``parallelism.expert_parallel_degree``, ``lr_scheduler.warmup_steps``...), so a
torchtitan user finds them where they expect. ``training.local_batch_size`` is
the number of sequences one data-parallel rank runs in one micro-step;
``training.global_batch_size`` the sequences of one optimizer step over all
ranks; their ratio gives the gradient-accumulation micro-steps.
The RL sections (``[rl]``, ``[rollout_engine]``, ``[sglang_engine]``) live in
``rl_sections.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from .rl_sections import RL, RolloutEngine, SGLangEngine  # re-exported: callers import them from here


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
    slot_cost_starts: list[float] = field(default_factory=lambda: [1.0])
    """foremoe with ``slot_overhead_tokens = "auto"``: each micro-step planned from these multiples of the slot cost,
    per layer the plan whose slowest rank is fastest on the time table kept (``PlannerConfig.slot_cost_starts``).
    One start by default: ``[0.5, 1, 2]`` plans ~3-4x longer with the two knobs below (docs/simulator.md, levers:
    Qwen3-30B-A3B 2.60 -> 2.32% above ideal at 64 GPUs), which a synchronous step hides only behind colocated engines
    falling asleep (``[rollout_engine] sleep_level`` 1) or with ``[rl] max_staleness`` 1: otherwise the recompute
    stage waits for its plans (the update's are taken one micro-step ahead, docs/placement.md)."""
    polish_chain_depth: int = 1
    """foremoe's time polish: the ranks that may shed per layer (1: the straggler only; k: when it has no move, the
    rank below it sheds, down to the k-th; ``PlannerConfig.polish_chain_depth``). 3 with the starts above: the
    levers of docs/simulator.md."""
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
