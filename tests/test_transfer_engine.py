"""The transfer engine on 2 gloo ranks: replicas arrive ahead of use by either path,
stay without a transfer, and their gradients are summed into the owners' shards."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from distributed_helpers import run_ranks

# 2 ranks, 4 experts: rank 0 owns 0, 1; rank 1 owns 2, 3; one spare slot each.
SLOTS_M_RC = [np.array([[0, 1, 2], [2, 3, 1]]), np.array([[0, 1, 2], [2, 3, 0]])]
LOADS_SE = np.array([[2, 2, 2, 2], [2, 2, 2, 2]])


def _assign(slots_RC):
    """Each expert's 4 tokens split evenly over the ranks hosting it."""
    hosts = np.zeros((4, 2), dtype=np.int64)
    for r in range(2):
        hosts[slots_RC[r], r] = 1
    return hosts * (4 // hosts.sum(1, keepdims=True))


def _engine_run(rank, world_size, path, out_path):
    import sys
    from pathlib import Path

    import torch.distributed as dist

    from titan_foremoe.placement.tables import compile_micro_step
    from titan_foremoe.planner.types import TRANSFER_DTYPE
    from titan_foremoe.transfer.engine import TransferEngine

    from titan_foremoe.transfer import engine as engine_mod

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from measure_bank_copies import CopyCounter, inside, storage_key

    dist.init_process_group("gloo")
    nodes = np.array([0, 1])  # two nodes: every move is inter-node
    grad_group = dist.new_group([0, 1])  # gradient returns on their own communicator
    engine = TransferEngine(dist.group.WORLD, rank, 2, nodes, path=path, grad_group=grad_group)
    on_grad_group = []  # per exchange: did it run on the gradient group
    real = engine_mod._all_to_all
    engine_mod._all_to_all = lambda send, ex, n, group, *a, **kw: (
        on_grad_group.append(group is grad_group) or real(send, ex, n, group, *a, **kw))
    torch.manual_seed(0)
    full = [torch.randn(4, 3, 5), torch.randn(4, 5, 3), torch.randn(4, 3, 5)]  # all experts, same on both ranks
    owned = tuple(w[2 * rank : 2 * rank + 2].clone().requires_grad_(True) for w in full)
    if path == "host":
        engine.refresh_host_copies(0, tuple(o.detach() for o in owned), torch.float32)
    intra, inter = engine.host_lanes()
    result = {}
    prev = prev_rows = None
    for m, slots in enumerate(SLOTS_M_RC):
        # micro-step 0: rank 0 gets expert 2 from rank 1, rank 1 gets expert 1 from rank 0;
        # micro-step 1: rank 0 keeps expert 2 (no move), rank 1 swaps its replica for expert 0.
        moves = [(0, 0, 2, 1, 0), (0, 0, 1, 0, 1)] if m == 0 else [(1, 0, 0, 0, 1)]
        moves = np.array([(*mv, True) for mv in moves], dtype=TRANSFER_DTYPE)
        rank_tables = compile_micro_step(slots[None], _assign(slots)[None], LOADS_SE[None], rank, 1,
                                         prev_slots_LRC=prev, moves_T=moves, stale=m == 0, host_intra=intra,
                                         host_inter=inter, prev_rows_LC=prev_rows)
        tables = rank_tables.layers[0]
        counter = CopyCounter()  # every aten copy and every all-to-all's output during the prefetch and the wait
        with counter:
            engine.prefetch(0, tuple(o.detach() for o in owned), tables.transfers, bank=m % 2, rows=1,
                            dtype=torch.float32)
            issued_ahead = engine.layers[0].pending.host is not None  # host lane: in flight until first use
            engine.wait(0)
        bank = engine.layers[0].banks[m % 2][0]  # (w1 of) the bank this micro-step fills
        lt = tables.transfers
        landed = [o for o in counter.all_to_all_outputs if o.numel()]
        row_bytes = 3 * 15 * 4
        copies = {"landed": len(landed), "received": len(lt.direct.recv_row_T) + len(lt.host.recv_row_T),
                  "outputs_in_bank": all(inside(o, bank) for o in landed),
                  "into_bank": counter.bytes_into({storage_key(bank)}), "total": counter.bytes_total(),
                  "kept": len(lt.keep_row_U) * row_bytes,
                  "sent": (len(lt.direct.send_row_T) + len(lt.host.send_row_T)) * row_bytes}
        w_C = [w.dense() for w in engine.slot_weights(0, owned, tables.slot_source_C, tables.transfers, bank=m % 2,
                                                      dtype=torch.float32)]
        coeff = torch.arange(1.0, 4.0)[:, None, None]  # slot c's weights weigh c + 1 in the loss
        (sum((w * coeff).sum() for w in w_C)).backward()
        result[m] = {"slots": [w.detach().clone() for w in w_C], "grad": [o.grad.clone() for o in owned],
                     "host_ahead": issued_ahead, "copies": copies}
        for o in owned:
            o.grad = None
        prev, prev_rows = slots[None], rank_tables.bank_row_LC
    result["stats"] = engine.stats
    result["on_grad_group"] = on_grad_group
    result["bank_bytes"] = engine.bank_bytes
    torch.save(result, f"{out_path}.{rank}")
    dist.destroy_process_group()


@pytest.mark.parametrize("path", ["direct", "host"])
def test_replicas_arrive_stay_and_return_gradients(tmp_path, path):
    run_ranks(_engine_run, 2, path, str(tmp_path / "out"), apply_patches=True)
    torch.manual_seed(0)
    full = [torch.randn(4, 3, 5), torch.randn(4, 5, 3), torch.randn(4, 3, 5)]
    res = [torch.load(tmp_path / f"out.{r}", weights_only=False) for r in range(2)]
    for m, slots in enumerate(SLOTS_M_RC):
        for r in range(2):
            for w_full, got in zip(full, res[r][m]["slots"]):
                assert torch.equal(got, w_full[torch.as_tensor(slots[r])])  # every slot holds its expert
        # gradient of expert e at its owner = sum over all ranks' slots hosting e of (slot index + 1)
        for r in range(2):
            for owned_i, e in enumerate(range(2 * r, 2 * r + 2)):
                expect = sum(c + 1 for rr in range(2) for c, ee in enumerate(slots[rr]) if ee == e)
                for g in res[r][m]["grad"]:
                    assert torch.all(g[owned_i] == expect), (path, m, r, e)
    # one gradient return per micro-step, on the gradient group; prefetches (direct) on the prefetch group
    used = res[0]["on_grad_group"]
    assert sum(used) == 2 and len(used) > 2  # the returns, and only they
    assert res[0][0]["host_ahead"] == res[1][0]["host_ahead"] == (path == "host")
    # replica rows land in their bank slot: the all-to-all's output buffer is the bank's storage (CPU: the host
    # lane's too), and a layer's prefetch + wait copies nothing but each sent row once and each kept row once
    for r in range(2):
        for m in range(2):
            c = res[r][m]["copies"]
            assert c["landed"] == (c["received"] > 0), (r, m, c)
            assert c["outputs_in_bank"], (r, m, c)
            assert c["into_bank"] == c["kept"], (r, m, c)  # no second copy of a received row
            assert c["total"] == c["sent"] + c["kept"], (r, m, c)
    assert res[0][1]["copies"]["kept"] > 0 and res[1][1]["copies"]["received"] > 0  # both kinds exercised
    assert res[0]["bank_bytes"] == 2 * 3 * 15 * 4  # two banks of one row (w1, w2, w3: 3 x 5 each), fp32
    stats = res[0]["stats"]
    assert stats.local_copies == 1  # rank 0 kept expert 2 in micro-step 1
    moved_by_host = stats.bytes_by_path["host"] > 0
    assert moved_by_host == (path == "host")
    assert (stats.bytes_by_path["inter_node"] > 0) == (path == "direct")
    assert (stats.seconds_by_path["host"] > 0) == (path == "host")


def _host_idle_rank(rank, world_size, out_path):
    """3 ranks on 3 nodes, host lane: ranks 0 and 1 swap replicas, rank 2 moves nothing in the layer."""
    import datetime

    import torch.distributed as dist

    from titan_foremoe.placement.tables import compile_micro_step
    from titan_foremoe.planner.types import TRANSFER_DTYPE
    from titan_foremoe.transfer.engine import TransferEngine

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    engine = TransferEngine(dist.group.WORLD, rank, 3, np.array([0, 1, 2]), path="host")
    torch.manual_seed(0)
    full = [torch.randn(6, 3, 5), torch.randn(6, 5, 3), torch.randn(6, 3, 5)]
    owned = tuple(w[2 * rank : 2 * rank + 2].clone() for w in full)
    engine.refresh_host_copies(0, owned, torch.float32)
    slots_RC = np.array([[0, 1, 2], [2, 3, 1], [4, 5, -1]])
    assign_ER = np.zeros((6, 3), dtype=np.int64)
    for r in range(3):
        hosted = slots_RC[r][slots_RC[r] >= 0]
        assign_ER[hosted, r] = 1
    assign_ER = assign_ER * (6 // assign_ER.sum(1, keepdims=True))
    tables = compile_micro_step(slots_RC[None], assign_ER[None], np.full((1, 3, 6), 2), rank, 1,
                                prev_slots_LRC=None, moves_T=np.zeros(0, dtype=TRANSFER_DTYPE), stale=True,
                                host_intra=True, host_inter=True).layers[0]
    engine.prefetch(0, owned, tables.transfers, bank=0, rows=1, dtype=torch.float32)
    w_C = [w.dense() for w in engine.slot_weights(0, owned, tables.slot_source_C, tables.transfers, bank=0,
                                                  dtype=torch.float32)]
    torch.save([w.detach().clone() for w in w_C], f"{out_path}.{rank}")
    dist.destroy_process_group()


def test_host_lane_with_an_idle_rank(tmp_path):
    """The host exchange is a collective: a rank with no host moves in a layer still joins it (else a hang)."""
    run_ranks(_host_idle_rank, 3, str(tmp_path / "out"), apply_patches=True)
    torch.manual_seed(0)
    full = [torch.randn(6, 3, 5), torch.randn(6, 5, 3), torch.randn(6, 3, 5)]
    for r, slots in enumerate([[0, 1, 2], [2, 3, 1], [4, 5]]):
        got = torch.load(tmp_path / f"out.{r}", weights_only=False)
        for w_full, w in zip(full, got):
            assert torch.equal(w[: len(slots)], w_full[torch.as_tensor(slots)])


def test_cuda_path_writes_the_bank_on_the_side_stream_after_the_compute_stream(monkeypatch):
    """Mocked device streams (the calls the CUDA backend makes): the direct all-to-all writes into the bank from
    the side stream, which first waits for the compute stream (its reads of the other bank and of the owned
    rows); both banks are ``record_stream``ed on the side stream; first use makes the compute stream wait for
    the side stream's event. (``test_checked_streams.py`` runs the same calls under the sanitizer's analysis.)"""
    from contextlib import contextmanager

    import torch.distributed as dist

    from titan_foremoe.placement.tables import compile_micro_step
    from titan_foremoe.planner.types import TRANSFER_DTYPE
    from titan_foremoe.transfer.engine import TransferEngine

    log, current = [], ["compute"]

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(("wait_stream", self.name, other.name))

        def wait_event(self, event):
            log.append(("wait_event", self.name, event.stream))

    class Event:
        def record(self, stream=None):
            self.stream = stream.name
            log.append(("event", stream.name))

    @contextmanager
    def on(stream):
        current[0] = stream.name
        yield
        current[0] = "compute"

    class Work:
        def wait(self):
            log.append(("work_wait", current[0]))

    def all_to_all(output, input, out_splits, in_splits, group=None, async_op=False):
        log.append(("all_to_all", current[0], output.data_ptr(), output.shape[0]))
        output.copy_(input)  # loopback: the row rank 0 sends stands for its peer's (the wire, not the engine)
        return Work()

    side = Stream("side")
    from titan_foremoe.distributed import device as dev

    monkeypatch.setattr(dev, "current_stream", lambda device=None: Stream(current[0]))
    monkeypatch.setattr(dev, "use_stream", on)
    monkeypatch.setattr(dev, "event", lambda enable_timing=False: Event())
    monkeypatch.setattr(dev, "record_stream", lambda t, s: log.append(("record_stream", s.name, t.data_ptr())))
    monkeypatch.setattr(dist, "all_to_all_single", all_to_all)
    engine = TransferEngine(object(), 0, 2, np.array([0, 0]))
    monkeypatch.setattr(engine, "_side_stream", lambda device: side)
    # 2 ranks, 4 experts, rank 0 holds a replica of expert 2 (from rank 1); rank 1 one of expert 1 (from rank 0)
    slots = np.array([[0, 1, 2], [2, 3, 1]])
    moves = np.array([(0, 0, 2, 1, 0, True), (0, 0, 1, 0, 1, True)], dtype=TRANSFER_DTYPE)
    lt = compile_micro_step(slots[None], _assign(slots)[None], LOADS_SE[None], 0, 2, prev_slots_LRC=None,
                            moves_T=moves, stale=True).layers[0].transfers
    owned = tuple(torch.randn(2, *s) for s in ((3, 5), (5, 3), (3, 5)))
    engine.prefetch(0, owned, lt, bank=1, rows=1, dtype=torch.float32)
    bank_ptr, other_ptr = engine.layers[0].packed[1].data_ptr(), engine.layers[0].packed[0].data_ptr()
    calls = [e for e in log if e != ("event", "compute")]  # less the exposed-time marks on the compute stream
    assert calls == [("wait_stream", "side", "compute"), ("record_stream", "side", bank_ptr),
                     ("record_stream", "side", other_ptr), ("all_to_all", "side", bank_ptr, 1), ("event", "side")]
    log.clear()
    engine.wait(0)
    calls = [e for e in log if e != ("event", "compute")]
    assert calls == [("work_wait", "compute"), ("wait_event", "compute", "side")]  # no copy after the wait
    # the row rank 0 sent (its owned expert 1) is what the fake wire delivered into the bank
    for w, b in zip(owned, engine.layers[0].banks[1]):
        assert torch.equal(b[0], w[1])


def test_refuses_bank_rows_out_of_arrival_order():
    """A receive numbered away from its lane's run would land in the wrong bank row: refused with a clear error."""
    from titan_foremoe.transfer.engine import TransferEngine
    from titan_foremoe.transfer.schedule import Exchange, LayerTransfers

    e, one = np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64)
    lt = LayerTransfers(Exchange(e, e, one, np.array([1])), Exchange(e, e, e, e), Exchange(e, e, e, e), e, e,
                        np.zeros(0, bool), stale=True, host_any=False)
    owned = tuple(torch.zeros(2, *s) for s in ((3, 5), (5, 3), (3, 5)))
    with pytest.raises(RuntimeError, match=r"layer 0: direct receive bank rows \[1\] are not 0.. in arrival order"):
        TransferEngine(None, 0, 2, np.array([0, 0])).prefetch(0, owned, lt, 0, 2, torch.float32)
