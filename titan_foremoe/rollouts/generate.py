"""Batched generation with a KV cache that records the routes of every fed token.

Prompts are left-padded into one batch and decoded together with per-row
positions. The prefill records the experts of every prompt token; each decode
step records those of the token it feeds. A sequence's last token (EOS, or
the ``max_new_tokens``-th) is sampled but never fed back, so it has no route:
the log covers positions ``0 .. T-2``, the convention of ``RoutingLog``.

With expert parallelism every forward is a collective (all-to-all, FSDP
all-gathers), so all ranks decode in lockstep and stop together when no row
on any rank is still active. Padding and finished rows are masked out of the
MoE layers: they are never dispatched and never counted as load.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch
from torch.distributed import ReduceOp
from torch.distributed.fsdp import FSDPModule
from torchtitan_patches.torch_compat import fsdp_param_groups

from ..distributed import collectives
from ..models.attention import CachedSDPA, KVCache
from ..models.decode_dispatch import fixed_capacity
from ..models.seams import moe_layers, recorded_routes, routing
from ..rl.grpo import token_logprobs
from ..routing_log import RoutingLog, route_dtype
from .sampling import sample


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0


@dataclass
class Rollout:
    tokens_BT: torch.Tensor
    """Prompt + completion, right-padded with ``pad_id``."""
    prompt_lens_B: torch.Tensor
    lengths_B: torch.Tensor
    """Tokens per sequence (prompt + completion)."""
    logprobs_BT: torch.Tensor
    """``log pi_T(token_t | tokens_<t)`` at the sampling temperature T (1 when greedy) for generated
    positions, else 0; recompute and update use the same T, so the importance ratio is exact."""
    finished_B: torch.Tensor
    """The completion ended with EOS (else it hit ``max_new_tokens``)."""
    routes: RoutingLog
    loss_mask_BT: torch.Tensor | None = None
    """Trained tokens (multi-turn rollouts: the assistant's output, not tool or user tokens); None: every
    completion token."""

    def completion(self, b: int) -> list[int]:
        return self.tokens_BT[b, int(self.prompt_lens_B[b]) : int(self.lengths_B[b])].tolist()

    @staticmethod
    def pick(parts: list["Rollout"], rows: list[tuple[int, int]], pad_id: int) -> "Rollout":
        """Rows ``(part, row)`` of several rollouts as one (right-padded to the widest; DAPO's refill)."""
        W = max(int(parts[p].lengths_B[r]) for p, r in rows)
        X, K = parts[0].routes.num_layers, parts[0].routes.top_k
        B = len(rows)
        tokens = torch.full((B, W), pad_id, dtype=parts[0].tokens_BT.dtype)
        logp = torch.zeros(B, W, dtype=parts[0].logprobs_BT.dtype)
        experts = torch.zeros(B, W, X, K, dtype=parts[0].routes.experts_BTXK.dtype)
        for b, (p, r) in enumerate(rows):
            n = min(W, parts[p].tokens_BT.shape[1])
            tokens[b, :n] = parts[p].tokens_BT[r, :n]
            logp[b, :n] = parts[p].logprobs_BT[r, :n]
            m = min(W, parts[p].routes.experts_BTXK.shape[1])
            experts[b, :m] = parts[p].routes.experts_BTXK[r, :m]
        col = lambda name: torch.stack([getattr(parts[p], name)[r] for p, r in rows])  # noqa: E731
        lengths = col("lengths_B")
        return Rollout(tokens, col("prompt_lens_B"), lengths, logp, col("finished_B"),
                       RoutingLog(experts, lengths.clone(), parts[0].routes.num_experts))


class _Caches:
    """Install a lazily-sized KV cache on every ``CachedSDPA`` for the duration of a rollout."""

    def __init__(self, model: torch.nn.Module, key_valid_BT: torch.Tensor, first_B: torch.Tensor | None = None):
        self.modules = [m for m in model.modules() if isinstance(m, CachedSDPA)]
        self.key_valid_BT = key_valid_BT
        self.first_B = first_B

    def __enter__(self):
        for m in self.modules:
            m.kv_cache = _LazyKVCache(self.key_valid_BT, self.first_B)
        return self

    def __exit__(self, *exc):
        for m in self.modules:
            m.kv_cache = None


class _LazyKVCache(KVCache):
    """Allocates its buffers from the first keys it sees (heads, head dim and dtype of that layer)."""

    def __init__(self, key_valid_BT: torch.Tensor, first_B: torch.Tensor | None = None):
        self.key_valid_BT = key_valid_BT
        self.first_B = first_B
        self.use_flash = None
        self.start = 0
        self.k_BTNH = None

    def write(self, k_BLNH, v_BLNH):
        if self.k_BTNH is None:
            B, T = self.key_valid_BT.shape
            self.k_BTNH = k_BLNH.new_zeros(B, T, *k_BLNH.shape[2:])
            self.v_BTNH = torch.zeros_like(self.k_BTNH)
        return super().write(k_BLNH, v_BLNH)


def _any_active(active_B: torch.Tensor) -> bool:
    """Any row active on any rank: the flag is all-reduced on the device and read once (the token's one sync)."""
    flag = active_B.any().to(torch.int64).reshape(1)
    return bool(collectives.all_reduce(flag, ReduceOp.MAX).item())


@contextmanager
def last_position_logits(model: torch.nn.Module):
    """Forwards in the block return logits ``[B, 1, V]`` of the last position only.

    The final norm's input is sliced before the norm and the output projection, so nothing of size
    ``[B, P, V]`` exists (Qwen3: V = 151,936; B = 64, P = 1024 in fp32 would be 40 GB)."""
    handle = model.norm.register_forward_pre_hook(lambda _, args: (args[0][:, -1:], *args[1:]))
    try:
        yield
    finally:
        handle.remove()


@contextmanager
def unsharded(model: torch.nn.Module):
    """Every FSDP2 module's parameters all-gathered once for the whole block, not per forward.

    A rollout runs one forward per decoded token; with FSDP's default
    (reshard after forward) each would all-gather every layer again. Here each
    module unshards once and stays unsharded until the block ends. Memory: the
    full bf16 parameters of the non-expert part, plus each rank's EP-local experts
    of every layer when FSDP shards them over ``efsdp`` > 1 (gathered once instead
    of once per token: Qwen3-30B-A3B at EP 8, 48 x 16 experts x 4.7 M x 2 B =
    7.2 GB per rank); with ``efsdp`` = 1 the experts have nothing to gather.
    """
    mods = [m for m in model.modules() if isinstance(m, FSDPModule)]
    saved = []
    for m in mods:
        state = m._get_fsdp_state()
        saved.append((state._auto_reshard_after_forward, [g.post_forward_mesh_info for g in fsdp_param_groups(state)]))
        m.set_reshard_after_forward(False, recurse=False)
    try:
        for m in mods:
            m.unshard()
        yield
    finally:
        for m, (auto, infos) in zip(mods, saved):
            state = m._get_fsdp_state()
            state._auto_reshard_after_forward = auto
            for g, info in zip(fsdp_param_groups(state), infos):
                g.post_forward_mesh_info = info
            m.reshard()


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompts: list[list[int]],
    cfg: GenerationConfig,
    *,
    eos_id: int | list[int],
    pad_id: int,
    num_experts: int,
    generator: torch.Generator,
    device: torch.device = torch.device("cpu"),
    padded_dispatch: bool = True,
) -> Rollout:
    """Sample completions; ``eos_id`` may list several ids (e.g. Qwen3's ``<|im_end|>`` and ``<|endoftext|>``).

    Logits, sampling, the sequence buffers and the routes stay on ``device``
    until the end; per token only one "any row active" flag crosses to the host. ``padded_dispatch``:
    decode steps use the fixed-capacity dispatch (``models/decode_dispatch.py``) where it fits its byte
    budget (False: the exact dispatch everywhere, the reference path).
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    eos_E = torch.tensor([eos_id] if isinstance(eos_id, int) else list(eos_id), device=device)
    if device.type != "cpu":  # a device generator, seeded from the caller's
        seed = int(torch.randint(2**62, (1,), generator=generator))
        generator = torch.Generator(device=device).manual_seed(seed)
    B = len(prompts)
    prompt_lens = torch.tensor([len(p) for p in prompts])
    P = int(prompt_lens.max())
    T_max = P + cfg.max_new_tokens
    pad_B = P - prompt_lens
    cols = torch.arange(P)
    tokens_BP = torch.full((B, P), pad_id, dtype=torch.int64)
    for b, p in enumerate(prompts):
        tokens_BP[b, P - len(p) :] = torch.tensor(p)
    valid_BP = cols[None, :] >= pad_B[:, None]
    positions_BP = (cols[None, :] - pad_B[:, None]).clamp_min(0)

    layers = moe_layers(model)
    num_layers = len(layers)
    top_k = layers[0].router.top_k
    seq_BT = torch.full((B, T_max), pad_id, dtype=torch.int64)
    for b, p in enumerate(prompts):
        seq_BT[b, : len(p)] = torch.tensor(p)
    seq_BT = seq_BT.to(device)
    routes_BTXK = torch.zeros(B, T_max, num_layers, top_k, dtype=route_dtype(num_experts), device=device)
    logp_BT = torch.zeros(B, T_max, device=device)
    key_valid_BT = torch.zeros(B, T_max, dtype=torch.bool, device=device)
    key_valid_BT[:, :P] = valid_BP.to(device)
    prompt_lens_d = prompt_lens.to(device)

    was_training = model.training
    model.eval()
    try:
        with unsharded(model), _Caches(model, key_valid_BT, pad_B.to(device)), ExitStack() as decode:
            with routing(model, token_mask_BL=valid_BP.to(device), record=True, layers=layers):
                with last_position_logits(model):  # left padding: every row's last prompt token is at P - 1
                    logits = model(tokens_BP.to(device), positions=positions_BP.to(device))
                rec = recorded_routes(model, layers)
            for b in range(B):
                routes_BTXK[b, : prompt_lens[b]] = rec[b, pad_B[b] :].to(routes_BTXK.dtype)
            next_logits_BV = logits[:, -1].float()
            if padded_dispatch:  # decode steps: the fixed-capacity dispatch where it fits
                decode.enter_context(fixed_capacity(layers, B, next(model.parameters()).dtype))

            # one host sync per token (the lockstep "any row active"): finished rows write what their
            # buffers already hold (pad, log-prob 0, route 0) instead of being selected by a mask
            active_B = torch.ones(B, dtype=torch.bool, device=device)
            gen_len_B = torch.zeros(B, dtype=torch.int64, device=device)
            rows_B = torch.arange(B, device=device)
            for t in range(cfg.max_new_tokens):
                tok_B = sample(next_logits_BV, temperature=cfg.temperature, top_p=cfg.top_p, generator=generator)
                tok_B = torch.where(active_B, tok_B, torch.full_like(tok_B, pad_id))
                pos_B = prompt_lens_d + t
                seq_BT[rows_B, pos_B] = tok_B
                logp_B = token_logprobs(next_logits_BV, tok_B, cfg.temperature)  # at the sampling T
                logp_BT[rows_B, pos_B] = logp_B.masked_fill(~active_B, 0.0)
                gen_len_B += active_B.to(torch.int64)
                active_B = active_B & ~(tok_B[:, None] == eos_E).any(-1)  # (isin may sync on CUDA for large B)
                if t == cfg.max_new_tokens - 1 or not _any_active(active_B):
                    break  # the token just sampled is the last one: it is never fed back
                key_valid_BT[:, P + t] = active_B
                with routing(model, token_mask_BL=active_B[:, None], record=True, layers=layers):
                    logits = model(tok_B[:, None], positions=pos_B[:, None])
                    rec = recorded_routes(model, layers)
                routes_BTXK[rows_B, pos_B] = rec[:, 0].to(routes_BTXK.dtype).masked_fill(~active_B[:, None, None], 0)
                next_logits_BV = logits[:, 0].float()
    finally:
        model.train(was_training)

    seq_BT, logp_BT, gen_len_B, routes_BTXK = seq_BT.cpu(), logp_BT.cpu(), gen_len_B.cpu(), routes_BTXK.cpu()
    lengths_B = prompt_lens + gen_len_B
    width = int(lengths_B.max())
    finished_B = torch.isin(seq_BT[torch.arange(B), lengths_B - 1], eos_E.cpu())
    return Rollout(
        tokens_BT=seq_BT[:, :width],
        prompt_lens_B=prompt_lens,
        lengths_B=lengths_B,
        logprobs_BT=logp_BT[:, :width],
        finished_B=finished_B,
        routes=RoutingLog(routes_BTXK[:, :width], lengths_B, num_experts),
    )
