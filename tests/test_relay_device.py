"""The NCCL one-group sync's relay on CUDA, with the device faked (``weight_buckets.Relay``, ``_Pipe``;
``vllm_weights.group_device``): the receive buffer, the stream NCCL runs on, the side stream and the packing's
event are the transfer group's device's, not the calling thread's current device (the pipe's worker thread
starts on device 0); a group vLLM disabled (no ``device``, a broadcast that moves nothing) is refused at the
join in one line instead of counting bytes it never received."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from titan_foremoe.rollouts.engines.errors import EngineError
from titan_foremoe.rollouts.engines.vllm_weights import ParamMeta, group_device
from titan_foremoe.rollouts.engines.weight_buckets import Bucket, Relay, _Pipe

GROUP_DEVICE = torch.device("cuda", 1)  # the relay's GPU; the threads' current device stays cuda:0


class FakeStream:
    def __init__(self, device, name):
        self.device, self.name, self.waited = torch.device(device), name, []

    def wait_event(self, event):
        self.waited.append(event)

    def synchronize(self):
        pass


class FakeBuffer:
    def __init__(self, size, device):
        self.size, self.device = size, torch.device(device)
        self.is_cuda = self.device.type == "cuda"


@pytest.fixture
def cuda(monkeypatch):
    """torch.cuda with two devices, the current one 0: ``current_stream(d)`` is d's current stream (the side
    stream inside ``torch.cuda.stream(side)``), ``current_stream()`` device 0's; ``torch.empty`` on a CUDA device
    a recording buffer."""
    state = {"current": {0: FakeStream("cuda:0", "default 0"), 1: FakeStream("cuda:1", "default 1")},
             "made": [], "recorded": []}

    def current_stream(device=None):
        return state["current"][torch.device("cuda", 0).index if device is None else torch.device(device).index]

    @contextmanager
    def use(stream):
        i = stream.device.index
        prev, state["current"][i] = state["current"][i], stream
        try:
            yield
        finally:
            state["current"][i] = prev

    def make_stream(device=None):
        s = FakeStream(device, "side")
        state["made"].append(s)
        return s

    class Event:
        def record(self, stream=None):
            state["recorded"].append(stream or current_stream())

    real_empty = torch.empty

    def empty(*shape, device=None, **k):
        if device is not None and torch.device(device).type == "cuda":
            return FakeBuffer(shape[0], device)
        return real_empty(*shape, device=device, **k)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.cuda, "Stream", make_stream)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch, "empty", empty)
    return state


class NcclGroup:
    """vLLM's ``PyNcclCommunicator`` as the relay sees it: ``device`` (set once NCCL is up), ``broadcast``
    asserting its tensor is on that device, recording the stream it was given."""

    def __init__(self, device=GROUP_DEVICE):
        self.device, self.calls = device, []

    def broadcast(self, tensor, src, stream=None):
        assert tensor.device == torch.device("cuda", self.device) if isinstance(self.device, int) else self.device
        self.calls.append((tensor.device, stream))


BUCKET = Bucket(0, [ParamMeta("w", "bfloat16", (4, 8))], None)


def test_the_relay_receives_on_its_groups_device_and_the_pipes_side_stream(cuda):
    """``sync_buckets``' relay path (``_Pipe.put`` with the relay's device, then ``Relay.receive`` on the pipe's
    worker thread): the side stream is made on the group's device, waits for an event recorded on that device's
    current stream, and the broadcast gets a buffer on the group's device and that side stream (old code: device
    0's default stream, ``current_stream()`` without a device)."""
    group = NcclGroup()
    relay = Relay(group)
    pipe = _Pipe()
    assert pipe.put(lambda _: relay.receive(BUCKET), None, relay.device) is None
    assert pipe.wait() is None
    pipe.close()
    side = cuda["made"]
    assert len(side) == 1 and side[0].device == GROUP_DEVICE
    assert [s.device for s in cuda["recorded"]] == [GROUP_DEVICE]  # the packing's event, on the group's device
    (dev, stream), = group.calls
    assert dev == GROUP_DEVICE and stream is side[0]
    assert relay.received == 4 * 8 * 2


def test_a_direct_receive_takes_the_groups_device_stream_not_the_current_devices(cuda):
    relay = Relay(NcclGroup())
    relay.receive(BUCKET)
    (dev, stream), = relay.group.calls
    assert dev == GROUP_DEVICE and stream.device == GROUP_DEVICE and stream.name == "default 1"


def test_an_int_device_is_a_cuda_index():
    assert group_device(NcclGroup(device=1)) == GROUP_DEVICE
    assert group_device(type("G", (), {})()) is None  # a host group (gloo stand-ins): the buffer on the host


def test_a_disabled_nccl_group_is_refused_at_the_join(cuda):
    """vLLM's communicator disables itself (``VLLM_DISABLE_PYNCCL``, no NCCL library) before setting ``device``,
    and its broadcast then returns without receiving: the relay (and a source's sender) refuse it in one line."""
    class Disabled:
        disabled = True

        def broadcast(self, tensor, src, stream=None):
            pass

    with pytest.raises(EngineError, match=r"^weight sync: the engine's NCCL transfer group is disabled"):
        Relay(Disabled())
