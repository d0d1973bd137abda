"""The policy's weights into an SGLang engine by broadcast (``[sglang_engine] weight_sync = "distributed"``, GPU).

SGLang's routes (``srt/entrypoints/http_server.py``, payloads ``srt/managers/io_struct.py``; 0.5.23 on PyPI):
once, ``POST /init_weights_update_group`` ``{"master_address", "master_port", "rank_offset", "world_size",
"group_name", "backend"}``: each of the engine's W workers joins a process group at rank ``rank_offset +
tp_rank`` (SGLang's ``init_custom_process_group``: a ``tcp://master_address:master_port`` rendezvous, a group
outside the default one) while trainer rank 0 joins it as rank 0. Every step: ``POST
/update_weights_from_distributed`` ``{"names", "dtypes", "shapes", "group_name", "flush_cache"}`` while rank 0
broadcasts the tensors in that same order (the engine receives each into a fresh buffer of that dtype and shape
and loads them by name; ``flush_cache`` drops the radix cache after). Both answer ``{"success", "message"}``,
HTTP 400 on failure.

The tensors are the HF export's (``HFWeightStream``, shared with the vLLM sender): the state dict, experts in
logical order, cast to the engine dtype, HF names, one parameter gathered at a time (``engines/vllm_weights.py``
for the cost at Qwen3-30B-A3B; the same bytes travel). The checks are the vLLM sender's: every tensor against what
the engine was told, the stream drawn to the end on any error, the update never retried.

Legend: W = the engine's workers; meta = (HF name, dtype name, shape).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from .vllm_server import EngineError
from .vllm_weights import NCCLWeightSender, ParamMeta

GROUP = "titan_foremoe_weights"
BACKEND = "nccl"
"""The group's backend the engine is asked to join (the CPU tests set ``gloo``)."""


class TorchGroup:
    """A ``torch.distributed`` process group with the ``broadcast(tensor, src, stream)`` the sender calls."""

    def __init__(self, group, device: torch.device | None = None):
        self.group, self.device = group, device

    def broadcast(self, tensor: torch.Tensor, src: int = 0, stream=None) -> None:
        torch.distributed.broadcast(tensor, src=src, group=self.group)


def _sglang_group(info: dict) -> TorchGroup:
    """Trainer rank 0 joins the group with SGLang's own helper (the engine workers' rendezvous), on its CUDA device."""
    try:
        from sglang.srt.utils import init_custom_process_group
    except ImportError:
        from sglang.srt.utils.common import init_custom_process_group
    group = init_custom_process_group(backend=info["backend"], world_size=info["world_size"], rank=0,
                                      init_method=f"tcp://{info['master_address']}:{info['master_port']}",
                                      group_name=info["group_name"])
    return TorchGroup(group, torch.device("cuda", torch.cuda.current_device()))


class SGLangWeightSender(NCCLWeightSender):
    """Trainer side of SGLang's weight update by broadcast, over its HTTP routes (module docstring).

    ``post(path, body)``: the engine client's POST with one attempt; ``open_group(info)``: joins the group as rank 0
    and returns something with ``broadcast(tensor, src, stream)`` (default: SGLang's helper, CUDA);
    ``backend``: ``BACKEND`` by default. Only rank 0 builds one."""

    update_route = "SGLang /update_weights_from_distributed"

    def __init__(self, post: Callable[[str, dict | None], object], *, master_address: str, master_port: int,
                 engine_workers: int, backend: str | None = None, open_group: Callable[[dict], object] | None = None):
        super().__init__(post, master_address=master_address, master_port=master_port, engine_workers=engine_workers,
                         open_group=open_group or (lambda info: _sglang_group(info)), stream=lambda: None)
        self.init_info = dict(master_address=master_address, master_port=master_port, rank_offset=1,
                              world_size=1 + engine_workers, group_name=GROUP, backend=backend or BACKEND)

    def _checked(self, path: str, body: dict) -> None:
        out = self.post(path, body)
        if isinstance(out, dict) and out.get("success") is False:
            raise EngineError(f"SGLang {path} refused: {out.get('message', out)}")

    def init(self) -> None:
        """The workers block in the POST until rank 0 joins: the POST runs on a side thread meanwhile."""
        with ThreadPoolExecutor(max_workers=1) as pool:
            done = pool.submit(self._checked, "/init_weights_update_group", dict(self.init_info))
            self.group = self.open_group(dict(self.init_info))
            done.result()

    def send(self, meta: list[ParamMeta], pairs: Iterable[tuple[str, torch.Tensor]],
             weight_version: str | None = None) -> None:
        """One weight update: the names, dtypes and shapes posted while ``pairs`` are broadcast in that order; the
        engine flushes its radix cache after loading. On any error the rest of ``pairs`` is still drawn.
        ``weight_version``: the vLLM sender's label, not sent (its rollouts are not checked against one)."""
        it = iter(pairs)
        try:
            if self.group is None:
                raise EngineError("SGLang weight sender used before init()")
            body = {"names": [m.name for m in meta], "dtypes": [m.dtype for m in meta],
                    "shapes": [list(m.shape) for m in meta], "group_name": GROUP, "flush_cache": True}
            pool = ThreadPoolExecutor(max_workers=1)
            try:
                done = pool.submit(self._checked, "/update_weights_from_distributed", body)
                self._broadcast(meta, it, done)
                done.result()  # the engine has loaded every tensor
            finally:
                pool.shutdown(wait=False)  # a failed broadcast leaves the engine blocked in it: never join
            self.updates += 1
        except BaseException:
            for _ in it:  # keep the other ranks' gathers company
                pass
            raise


class SGLangBucketSender(SGLangWeightSender):
    """The source rank's side of SGLang's distributed update in buckets (``weight_buckets``): the group is this
    rank, ``relays`` more trainer ranks, then the engine's workers (``rank_offset = 1 + relays``); each bucket is one
    ``/update_weights_from_distributed`` naming its tensors with ``load_format = "flattened_bucket"`` (SGLang
    receives the bucket's bytes back to back as one uint8 broadcast and splits them by the names' dtypes and
    shapes), the radix cache flushed with the sync's last. Driven bucket by bucket: ``begin``, ``send_bucket``,
    ``end``. Several senders (``[sglang_engine] weight_sync_senders``) are one each, in groups of their own
    ``group_name``: SGLang keeps its workers' groups by name and takes one group's update at a time."""

    def __init__(self, post: Callable[[str, dict | None], object], *, master_address: str, master_port: int,
                 engine_workers: int, relays: int = 0, backend: str | None = None,
                 open_group: Callable[[dict], object] | None = None, group_name: str = GROUP):
        super().__init__(post, master_address=master_address, master_port=master_port, engine_workers=engine_workers,
                         backend=backend, open_group=open_group)
        self.init_info.update(rank_offset=1 + relays, world_size=1 + relays + engine_workers, group_name=group_name)
        self.buckets = 0

    def begin(self, meta: list[ParamMeta], buckets: int) -> None:
        if self.group is None:
            raise EngineError("SGLang weight sender used before init()")
        self.buckets = buckets

    def send_bucket(self, flat: torch.Tensor, index: int, metas: list[ParamMeta]) -> None:
        body = {"names": [m.name for m in metas], "dtypes": [m.dtype for m in metas],
                "shapes": [list(m.shape) for m in metas], "group_name": self.init_info["group_name"],
                "flush_cache": index == self.buckets - 1, "load_format": "flattened_bucket"}
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            done = pool.submit(self._checked, "/update_weights_from_distributed", body)
            device = getattr(self.group, "device", None)
            self.group.broadcast(flat if device is None else flat.to(device), src=0)
            done.result()  # the engine has loaded this bucket
        finally:
            pool.shutdown(wait=False)  # a failed broadcast leaves the engine blocked in it: never join

    def end(self, weight_version: str | None = None) -> None:
        self.updates += 1

    def abort(self) -> None:
        pass


def sglang_relay_group(info: dict, rank: int) -> TorchGroup:
    """A relay's side of the group (rank ``rank`` of it, 1 <= rank < rank_offset), with SGLang's own helper."""
    try:
        from sglang.srt.utils import init_custom_process_group
    except ImportError:
        from sglang.srt.utils.common import init_custom_process_group
    group = init_custom_process_group(backend=info["backend"], world_size=info["world_size"], rank=rank,
                                      init_method=f"tcp://{info['master_address']}:{info['master_port']}",
                                      group_name=info["group_name"])
    return TorchGroup(group, torch.device("cuda", torch.cuda.current_device()))
