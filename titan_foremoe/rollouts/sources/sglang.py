"""The SGLang source: a live SGLang engine generates each step's rollouts from the policy's current weights.

The step is the vLLM source's (``sources/vllm.py``: weight sync, probe, generate; the engine restarted on the
current weights if it dies), with SGLang's calls (``engines/sglang_server.py``):

1. **weight sync** (collective): every rank writes its slices of the policy into an HF folder (two, alternating);
   rank 0 posts ``/update_weights_from_disk`` with it, then ``/flush_cache`` (the radix cache's KV and the routes
   recorded at its slots belong to the old weights). ``weight_sync = "restart"``: a fresh launched engine on
   the folder instead; ``"distributed"`` (GPU): after the first launch no folder, rank 0 broadcasts the weights
   (``engines/sglang_weights.py``). The first step launches the engine (or connects to ``url``).
2. **probe** (collective): the prompt log-probs (``logprob_start_len`` 0) and routes of rank 0's first prompt
   against the trainer's with those routes replayed; a gap above ``probe_tolerance`` stops the job.
3. **generate**: one ``/generate`` per sample (``input_ids`` in, ``output_ids`` out, ``return_logprob``,
   ``return_routed_experts``); the flat int32 routes are shaped ``[P + G - 1, X, K]`` by the policy's layer
   count and top-k, and any other length is an error naming both.

Config: ``[sglang_engine]`` (keys mirror ``[rollout_engine]``); docs/rollouts_sglang.md.
"""

from __future__ import annotations

from .vllm import VLLMSource, source_address


class SGLangSource(VLLMSource):
    """Rollouts from an SGLang engine that gets the policy's weights every step (module docstring)."""

    engine_name = "SGLang"
    section = "sglang_engine"
    stream_sync = "distributed"
    engine_kind = "sglang"

    def senders(self) -> int:
        """SGLang keeps its workers' update groups by name, so several sources each send a share of the buckets
        (``[sglang_engine] weight_sync_senders``; the engine takes one group's update at a time)."""
        return self.eng.weight_sync_senders

    def _new_sender(self, relays: int = 0, index: int = 0, fleet=None):
        """A source: SGLang's distributed update in buckets (``engines/sglang_weights.py``) in the group named for
        its ``index``, one attempt per call."""
        from ..engines.sglang_weights import GROUP, SGLangBucketSender
        from ..engines.vllm_server import free_port

        client = self.client
        return SGLangBucketSender(lambda path, body: client.post(path, body, retry=False),
                                  master_address=source_address(self.rank, self.eng.nccl_address, client.url),
                                  master_port=free_port(),
                                  engine_workers=self.eng.gpus_per_engine, relays=relays,
                                  group_name=f"{GROUP}_{index}")

    @staticmethod
    def relay_group(info: dict, rank: int):
        from ..engines.sglang_weights import sglang_relay_group

        return sglang_relay_group(info, rank)
