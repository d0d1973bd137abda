"""NCCL's issue order across communicators over the same ranks, checked on CPU (``distributed/issue_order.py``):
two gloo ranks, two communicators over both, under the checked backend. The same order passes; an injected
reordering (or the same order from another stream) fails on every rank, naming the first divergence."""

from __future__ import annotations

from distributed_helpers import run_ranks


def _issue(rank: int, swap_on_rank1: bool, side_on_rank1: bool) -> None:
    import torch
    import torch.distributed as dist

    from titan_foremoe.distributed import device as dev
    from titan_foremoe.distributed.checked import checking
    from titan_foremoe.distributed.issue_order import IssueOrderError

    a, b = dist.new_group([0, 1]), dist.new_group([0, 1])  # the EP group and a twin
    with checking() as c:
        side = dev.new_stream(None)
        x, y = torch.ones(4, device="cpu"), torch.ones(4, device="cpu")  # device tensors (factory with device=)
        assert c.is_device(x)
        side.wait_stream(dev.current_stream())
        order = [(a, x), (b, y)]
        if swap_on_rank1 and rank == 1:
            order.reverse()  # async: gloo runs each group on its own thread, so this completes here
        works = []
        for group, t in order:
            with dev.use_stream(side) if side_on_rank1 and rank == 1 and group is b else dev.use_stream(
                    dev.current_stream()):
                works.append(dist.all_reduce(t, group=group, async_op=True))
        for w in works:
            w.wait()
        bad = swap_on_rank1 or side_on_rank1
        try:
            with dev.strict("the test stage"):
                pass
        except IssueOrderError as e:
            msg = str(e)
            assert bad, msg
            assert msg.startswith("collective issue order differs on the communicators over ranks [0, 1] "
                                  "(checked at the end of the test stage): collective "), msg
            if swap_on_rank1:
                assert f"collective 0 since the start: rank 0 issued allreduce_ on group {a.group_name}" in msg, msg
                assert f"rank 1 issued allreduce_ on group {b.group_name} from the compute stream" in msg, msg
            else:
                assert "collective 1 since the start" in msg and "rank 1 issued allreduce_" in msg, msg
                assert "from the side stream" in msg, msg
            return
        assert not bad
        assert c.issue_order.checks == 1 and c.issue_order.sequences[(0, 1)].count == 2
        with dev.strict("a second stage"):  # the running digests still agree; logs were cleared
            dist.all_reduce(x, group=b)
        assert c.issue_order.checks == 2 and c.issue_order.sequences[(0, 1)].log == []


def _scenarios(rank: int, world_size: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    for swap, side in [(False, False), (True, False), (False, True)]:  # same order, reordered, other stream
        _issue(rank, swap, side)
    dist.destroy_process_group()


def test_issue_order_across_twin_communicators():
    run_ranks(_scenarios, 2, apply_patches=False)
