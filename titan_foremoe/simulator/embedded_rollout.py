"""The embedded rollout (``[rl] rollout_source = "embedded"``) as ``rollouts/generate.py`` runs it on the trainer.

Each rank left-pads its prompts into one static batch of B rows (P = its longest prompt) and decodes them on the
policy itself, weights unsharded (``unsharded``: the dense layers whole on every rank, each rank its E / ep
experts). Every decode step is a collective: the experts' all-to-all over the EP group, and one "any row
active" flag all-reduced over the **whole job** (``_any_active``: ``collectives.all_reduce`` on the default
group), read on the host. So every rank of the job steps in lockstep until the job's longest row ends
(``lockstep = "world"``, what runs; ``"ep_group"``: what a flag over the EP group alone would charge, each group
until its own longest row), and a static batch keeps its finished rows: the dense layers and attention run on all
B rows each step, only the experts skip finished rows (masked out of the dispatch). Per step and layer, on one
rank:

* dense projections and the head: measured bf16 GEMM rows at m = B (the layer's weights whole: no TP);
* routed experts: ``torch._grouped_mm`` (the trainer's kernel table) on the rank's E / ep experts, the group's
  active rows' top-k pairs spread evenly over its experts (at the mean active rows over the steps); the
  fixed-capacity dispatch and combine move B x top-k rows each over the EP group (``decode_dispatch``);
* attention: SDPA over a boolean mask with GQA (``models/attention.py``'s ``CachedSDPA``): charged at PyTorch's
  math kernel (``attention = "math"``: it repeats K and V to every query head, materializes the scores and a
  float mask, softmax, then the value product: ~(1 + 2 H / H_kv) x the KV bytes plus four passes over the
  scores) at the HBM rate, over the padded context P + t of every row; ``"fused"`` reads the KV once (what a
  flash / memory-efficient kernel would);
* a floor of ``kernels_per_layer`` launches at ``launch_us`` (eager PyTorch, no CUDA graphs; assumed 30 x 5 us),
  and the flag's all-reduce and host read per token.
The prefill: the B x P padded prompt tokens' FLOPs on one GPU at the dense rate. Before it, one all-gather of
the rank's dense-weight shards (``unsharded``) over NVLink.

Legend: B rows per rank, P longest prompt, S decode steps, H / H_kv query / KV heads.
"""

from __future__ import annotations

import numpy as np

from .calibration import Calibration
from .models import ModelSpec
from .rollout import _Gemm, prefill_ms
from .timing import DeviceCosts

LOCKSTEP = ("world", "ep_group")
ATTENTION = ("math", "fused")


def attention_bytes_per_row(model: ModelSpec, context: float, attention: str) -> float:
    """HBM bytes one layer's decode attention moves for one row at ``context`` keys (bf16, fp32 mask)."""
    kv = 2 * context * model.n_kv_heads * model.head_dim * 2.0  # K and V read once
    if attention == "fused":
        return kv
    expanded = 2 * context * model.n_heads * model.head_dim * 2.0  # K, V repeated to every query head
    scores = model.n_heads * context * 2.0
    return kv + 2 * expanded + 4 * scores + context * 5.0  # write + read the copies; scores 4 passes; mask


def embedded_rollout_ms(model: ModelSpec, cal: Calibration, link: DeviceCosts, lens_by_group: list[np.ndarray], ep: int,
                        prompt_tokens: int, hbm_Bps: float, lockstep: str = "world", attention: str = "math",
                        launch_us: float = 5.0, kernels_per_layer: int = 30) -> dict:
    """The embedded loop's time (module docstring): ``lens_by_group``, each EP group's responses (generated
    tokens each, dealt over its ep ranks in turn: ``ceil(len / ep)`` rows per rank); the slowest group sets the
    time."""
    if lockstep not in LOCKSTEP or attention not in ATTENTION:
        raise ValueError(f"embedded rollout: lockstep {lockstep!r} of {LOCKSTEP}, attention {attention!r} of "
                         f"{ATTENTION}")
    gemm = _Gemm(cal, link, hbm_Bps)
    D, L = model.dim, model.num_layers
    world_steps = max(float(np.max(x)) for x in lens_by_group)
    curve = cal.curve(D, model.moe_hidden)
    local = max(model.num_experts // ep, 1)
    worst: dict | None = None
    for lens in lens_by_group:
        lens = np.asarray(lens, np.float64)
        B = int(-(-len(lens) // ep))
        S = world_steps if lockstep == "world" else float(lens.max())
        P = prompt_tokens
        dense = L * gemm(B, model.attn_linear_flops() / (2.0 * D), D) + gemm(B, model.vocab, D)
        if model.dense_layers:
            dense += model.dense_layers * gemm(B, 3 * model.dense_hidden, D)
        if model.shared_hidden:
            dense += model.moe_layers * gemm(B, 3 * model.shared_hidden, D)
        pairs = lens.sum() / S / ep * model.top_k  # a rank's share of the group's active pairs, mean over steps
        tok_E = np.full((1, local), pairs * ep / model.num_experts)
        experts = model.moe_layers * float(curve.rank_ms(tok_E, backward=False)[0])
        a2a_bytes = B * model.top_k * D * link.act_bytes * (ep - 1) / ep  # fixed capacity: every row's slots
        a2a = 0.0
        if ep > 1:
            t = link.a2a_s_MLPR(np.array([a2a_bytes, 0.0])[None, None, :, None])
            a2a = 2 * model.moe_layers * (link.a2a_latency_us * 1e-3 + float(t.max()) * 1e3)
        ctx_sum = S * P + S * (S - 1) / 2  # sum over steps of the padded context P + t
        attn_total = L * B * attention_bytes_per_row(model, ctx_sum, attention) / hbm_Bps * 1e3  # linear in ctx
        per_step = {"dense": dense, "experts": experts, "dispatch": a2a}
        work_ms = sum(per_step.values()) * S + attn_total
        floor_ms = S * L * kernels_per_layer * launch_us * 1e-3
        flag_ms = S * (link.allgather_latency_us + 20.0) * 1e-3  # the flag's all-reduce and host read (assumed)
        decode = max(work_ms, floor_ms) + flag_ms
        pre = prefill_ms(model, link, B, P, 1)
        unshard = model.dense_params() * 2.0 * (ep - 1) / ep / (link.nvlink_GBps * 1e9) * 1e3
        total = pre + decode + unshard
        if worst is None or total > worst["rollout_ms"]:
            worst = {"rollout_ms": total, "prefill_ms": pre, "decode_ms": decode, "unshard_ms": unshard,
                     "decode_parts_ms": {**{k: v * S for k, v in per_step.items()}, "attention": attn_total,
                                         "launch_floor": floor_ms, "flag": flag_ms},
                     "decode_steps": S, "rows_per_rank": B, "group_longest": float(lens.max()),
                     "lockstep": lockstep, "attention": attention}
    return worst
