"""Host-sync census: ops of one RL step that would make the host wait for the device on CUDA, per stage.

    python benchmarks/count_host_syncs.py --balancers off,static,foremoe,reactive --out DIR

Per balancer, on 2 gloo ranks (EP 2, ``train_configs/debug_tiny_rl.toml``, a short supervised warm-up,
small batches), one RL step runs under a ``TorchDispatchMode`` with the model at n and n+1 MoE layers
(``--layers``); what one more layer adds, divided by the stage's model forwards, is the cost **per MoE
layer per micro-step** (recompute, update) or **per decoded token** (rollout: one forward per decoded
token after the prefill). The optimizer step is counted per optimizer step. Writes ``DIR/census.json``
(rank 0's counts, kinds and call sites) and prints a table.

What counts (the rule; everything is on CPU here, so a device-to-host copy is not visible as such):

* ops that synchronize on CUDA, seen in the dispatch mode wherever they come from (torch, torchtitan,
  this project): ``_local_scalar_dense`` (``.item()``, ``int(t)``, ``float(t)``), ``nonzero``,
  ``masked_select``, ``index``/``index_put`` with a boolean index, ``equal``, ``bincount``, ``unique*``,
  ``repeat_interleave`` without ``output_size``;
* device-to-host reads: ``.tolist()``, ``.numpy()`` and ``.cpu()`` of a tensor, called from project code
  (``.to("cpu")`` is not counted: a read of its result by one of those is)
  (``titan_foremoe/``, ``torchtitan/``). Reads from the metric loggers in ``HOST_METADATA`` are of host
  tensors on CUDA too (lists gathered through ``distributed/collectives.py``): they are listed as
  ``host:...`` and left out of every total. Other stage-level reads may be of host tensors (an upper bound);
  in a MoE layer every tensor is a device tensor;
* uploads: every call of ``titan_foremoe.distributed.uploads.upload``, and every
  ``torch.as_tensor``/``torch.tensor`` of host data with an explicit ``device=`` from project code (the
  way the code before the helper uploaded). ``Tensor.to(device)`` of a host tensor is not counted.

Call sites are ``file:line`` of the first project frame. Only rank 0's counts are written.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from titan_foremoe.distributed.checked import sync_kind  # the kinds of op that sync on CUDA

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

HOST_METADATA = {"_log_placements", "gather_placement_metrics", "placement_metrics", "rank_load_metrics",  # read host tensors
                 "micro_step_balance_metrics", "log_micro_step_balances"}
# the project's own package and torchtitan's, by their install folders: a name match would also take torch's
# frames for ours when the virtual environment sits under a folder called titan_foremoe (CI's cache)
_PROJECT = tuple(importlib.util.find_spec(m).submodule_search_locations[0] + os.sep for m in ("titan_foremoe", "torchtitan"))
_SKIP = ("uploads.py", "count_host_syncs.py")

OVERRIDES = [  # small, so that one balancer runs in well under a minute on 2 loaded cores
    "--metrics.enable_tensorboard=false", "--parallelism.expert_parallel_degree=2",
    "--rl.sft_warmup_steps=2", "--training.steps=1", "--training.local_batch_size=4",
    "--training.global_batch_size=8", "--rl.samples_per_prompt=4", "--rl.max_new_tokens=4",
    "--rl.updates_per_rollout=2",
]


def _site() -> tuple[str, bool]:
    """(file:line of the first project frame on the stack, else the first non-torch frame; whether that
    frame is a metric logger of ``HOST_METADATA``)."""
    f = sys._getframe(2)
    fallback = None
    while f is not None:
        name = f.f_code.co_filename
        if any(p in name for p in _PROJECT) and not name.endswith(_SKIP):
            path = name.split(os.sep + "site-packages" + os.sep)[-1].split(str(ROOT) + os.sep)[-1]
            return f"{path}:{f.f_lineno}", f.f_code.co_name in HOST_METADATA
        if fallback is None and os.sep + "torch" + os.sep not in name and not name.endswith(_SKIP):
            fallback = f"{os.path.basename(name)}:{f.f_lineno}"
        f = f.f_back
    return fallback or "?", False


def _from_project(depth: int = 2) -> bool:
    name = sys._getframe(depth).f_code.co_filename
    return any(p in name for p in _PROJECT) and not name.endswith(_SKIP)


class Census(TorchDispatchMode):
    """Counts syncing ops, D2H reads and uploads by (stage, kind, site) while active."""

    def __init__(self):
        super().__init__()
        self.stage = ["other"]
        self.counts = collections.Counter()  # (stage, kind, site) -> n
        self.forwards = collections.Counter()  # stage -> model forwards
        self.rollout_marks: list[collections.Counter] = []  # rollout counts by (kind, site) at each forward

    def mark_forward(self) -> None:
        stage = self.stage[-1]
        self.forwards.update([stage])
        if stage == "rollout":  # the prefill, then one forward per decoded token
            self.rollout_marks.append(collections.Counter(
                {(k, s): v for (st, k, s), v in self.counts.items() if st == "rollout" and not k.startswith("host:")}))

    def per_decoded_token(self) -> tuple[float, dict[str, float]]:
        """Ops between the first and the last decode forward, per decoded token: the decode loop alone (no
        prefill, no once-per-rollout bookkeeping, no scoring)."""
        m = self.rollout_marks
        if len(m) < 3:
            return float("nan"), {}
        diff = m[-1] - m[1]
        n = len(m) - 2
        return sum(diff.values()) / n, {f"{k} @ {s}": v / n for (k, s), v in diff.most_common()}

    def add(self, kind: str) -> None:
        site, host = _site()
        node = torch._C._current_autograd_node()
        if node is not None:  # in backward the Python stack ends at the .backward() call
            site += f" (backward of {node.name()})"
        if host:
            kind = "host:" + kind
        self.counts[(self.stage[-1], kind, site)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kind = sync_kind(func, args, kwargs)
        if kind is not None:
            self.add(kind)
        return func(*args, **kwargs)


def _patch(census: Census):
    """Python-level D2H reads and uploads (invisible to a dispatch mode on CPU); returns the undo."""
    undo = []

    def wrap(owner, attr, kind, when):
        orig = getattr(owner, attr)

        def wrapper(*a, **k):
            if _from_project() and when(a, k):
                census.add(kind)
            return orig(*a, **k)
        setattr(owner, attr, wrapper)
        undo.append(lambda: setattr(owner, attr, orig))

    always = lambda a, k: True  # noqa: E731
    wrap(torch.Tensor, "tolist", "d2h(tolist)", always)
    wrap(torch.Tensor, "numpy", "d2h(numpy)", always)
    wrap(torch.Tensor, "cpu", "d2h(cpu)", always)
    host_data = lambda a, k: k.get("device") is not None and not isinstance(a[0] if a else k.get("data"), torch.Tensor)  # noqa
    wrap(torch, "as_tensor", "upload(as_tensor)", host_data)
    wrap(torch, "tensor", "upload(tensor)", host_data)
    try:
        from titan_foremoe.distributed import uploads
        undo.append(uploads.observe(lambda nbytes: census.add("upload(helper)")))
    except ImportError:  # the code before the helper
        pass
    return lambda: [u() for u in reversed(undo)]


def _staged(census: Census, name: str, fn):
    def run(*a, **k):
        census.stage.append(name)
        try:
            return fn(*a, **k)
        finally:
            census.stage.pop()
    return run


def _run_one(balancer: str, n_layers: int, tmp: str, inject=None, overrides=()) -> tuple[Census, int]:
    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    cfg = load_config("train_configs/debug_tiny_rl.toml", OVERRIDES + [
        f"--job.dump_folder={tmp}/{balancer}_{n_layers}", f"--balance.balancer={balancer}",
        f"--model.n_layers={n_layers}", *overrides])
    trainer = RLTrainer(cfg)
    if inject is not None:
        inject(trainer)
    warm = cfg.rl.sft_warmup_steps
    for step in range(warm):
        trainer.run_job_step(step)
        trainer.step = step + 1
    census = Census()
    trainer.source.next_batch = _staged(census, "rollout", trainer.source.next_batch)
    trainer.recompute = _staged(census, "recompute", trainer.recompute)
    trainer.update = _staged(census, "update", trainer.update)
    trainer.optimizer_step = _staged(census, "optimizer", trainer.optimizer_step)
    trainer.model.register_forward_pre_hook(lambda *_: census.mark_forward())
    undo = _patch(census)
    try:
        with census:
            trainer.run_job_step(warm)
    finally:
        undo()
    opt_steps = cfg.rl.updates_per_rollout
    trainer.close()
    return census, opt_steps


def _summarize(runs: dict[int, tuple[Census, int]]) -> dict:
    """Per stage: totals at each layer count, and one more MoE layer's ops per forward (per optimizer step)."""
    (n0, (c0, steps)), (n1, (c1, _)) = sorted(runs.items())
    out = {"layers": [n0, n1], "stages": {}}
    for stage in ("rollout", "recompute", "update", "optimizer", "other"):
        per = {}
        for n, c in ((n0, c0), (n1, c1)):
            items = {(k, s): v for (st, k, s), v in c.counts.items() if st == stage and not k.startswith("host:")}
            denom = steps if stage == "optimizer" else max(c.forwards[stage], 1) if stage != "other" else 1
            per[n] = dict(total=sum(items.values()), forwards=c.forwards[stage], denom=denom, items=items)
        k0, k1 = collections.Counter(), collections.Counter()
        for k, p in ((k0, per[n0]), (k1, per[n1])):
            for (kind, _), v in p["items"].items():
                k[kind] += v
        layer_kinds = {k: k1[k] / per[n1]["denom"] - k0[k] / per[n0]["denom"] for k in set(k0) | set(k1)}
        sites1 = collections.Counter({f"{k} @ {s}": v for (k, s), v in per[n1]["items"].items()})
        sites0 = collections.Counter({f"{k} @ {s}": v for (k, s), v in per[n0]["items"].items()})
        layer_sites = {s: sites1[s] / per[n1]["denom"] - sites0[s] / per[n0]["denom"] for s in set(sites0) | set(sites1)}
        out["stages"][stage] = {
            "per_unit": "optimizer step" if stage == "optimizer" else "step" if stage == "other" else
            "decoded token (model forward)" if stage == "rollout" else "micro-step (model forward)",
            "forwards": {str(n): per[n]["forwards"] for n in per},
            "total": {str(n): per[n]["total"] for n in per},
            f"per_unit_at_{n0}_layers": per[n0]["total"] / per[n0]["denom"],
            "per_moe_layer_per_unit": round(sum(layer_kinds.values()), 3),
            "per_moe_layer_by_kind": {k: round(v, 3) for k, v in sorted(layer_kinds.items()) if abs(v) > 1e-9},
            "per_moe_layer_by_site": {k: round(v, 3) for k, v in sorted(layer_sites.items(), key=lambda kv: -abs(kv[1]))
                                      if abs(v) > 1e-9},
            f"sites_at_{n1}_layers": dict(sites1.most_common()),
            f"host_metadata_reads_at_{n1}_layers": sum(v for (st, k, _), v in c1.counts.items()
                                                       if st == stage and k.startswith("host:")),
        }
        if stage == "rollout":
            (t0, _), (t1, sites) = c0.per_decoded_token(), c1.per_decoded_token()
            out["stages"][stage].update({f"decode_per_token_at_{n0}_layers": t0, f"decode_per_token_at_{n1}_layers": t1,
                                         f"decode_sites_at_{n1}_layers": sites})
    return out


def _rank(rank, world_size, balancers, layers, out_path, tmp, inject=None, overrides=()):
    import torch.distributed as dist

    result = {}
    runs = [(b, b, None) for b in balancers] + ([(f"{balancers[-1]}+injected", balancers[-1], inject)] if inject else [])
    for label, b, fn in runs:  # one dump folder for all ranks: their configs must agree (train/guards.py)
        result[label] = _summarize({n: _run_one(b, n, tmp, fn, overrides) for n in layers})
    if rank == 0:
        Path(out_path).write_text(json.dumps(result, indent=1, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()


CHECKED = ["--debug.check_streams=true", "--activation_checkpoint.mode=full",
           "--training.global_batch_size=16"]  # 4 ranks: EP 2, experts FSDP-sharded over 2


def _run_checked(balancer: str, n_layers: int, tmp: str) -> dict:
    """One RL step under the checked backend: its host syncs (every kind it sees: reads, event/stream/device
    synchronizes, pageable moves) by (stage, inside the stage's micro-steps or not, kind)."""
    from titan_foremoe.config import load_config
    from titan_foremoe.train.rl_trainer import RLTrainer

    cfg = load_config("train_configs/debug_tiny_rl.toml", OVERRIDES + CHECKED + [
        f"--job.dump_folder={tmp}/{balancer}_{n_layers}", f"--balance.balancer={balancer}",
        f"--model.n_layers={n_layers}"])
    trainer = RLTrainer(cfg)
    for step in range(cfg.rl.sft_warmup_steps):
        trainer.run_job_step(step)
        trainer.step = step + 1
    at = Census()  # only its stage stack and forward counts: the backend does the counting
    counts = collections.Counter()
    trainer.device_backend.observers.append(
        lambda kind, site, region: counts.update([(at.stage[-1], region is not None, kind)]))
    trainer.source.next_batch = _staged(at, "rollout", trainer.source.next_batch)
    trainer.recompute = _staged(at, "recompute", trainer.recompute)
    trainer.update = _staged(at, "update", trainer.update)
    trainer.optimizer_step = _staged(at, "optimizer", trainer.optimizer_step)
    trainer.model.register_forward_pre_hook(lambda *_: at.forwards.update([at.stage[-1]]))
    trainer.run_job_step(cfg.rl.sft_warmup_steps)
    trainer.close()
    return {"counts": counts, "forwards": dict(at.forwards), "optimizer_steps": cfg.rl.updates_per_rollout}


def _summarize_checked(runs: dict[int, dict]) -> dict:
    """Per stage: host syncs per micro-step inside its micro-steps (and per MoE layer: one more layer's), and
    outside them per optimizer step (update, optimizer) or per stage (recompute)."""
    (n0, r0), (n1, r1) = sorted(runs.items())
    out = {"layers": [n0, n1]}
    for stage in ("recompute", "update"):
        inside = [{k: v for (st, ins, k), v in r["counts"].items() if st == stage and ins} for r in (r0, r1)]
        per = [sum(c.values()) / max(r["forwards"].get(stage, 0), 1) for c, r in zip(inside, (r0, r1))]
        kinds = {k: r1["counts"][(stage, True, k)] / max(r1["forwards"].get(stage, 0), 1) for k in inside[1]}
        out[stage] = {"micro_steps": r1["forwards"].get(stage, 0), "per_micro_step": per[0],
                      "per_moe_layer_per_micro_step": round(per[1] - per[0], 3), "inside_by_kind": kinds}
    steps = r0["optimizer_steps"]
    boundary = {k: v for (st, ins, k), v in r0["counts"].items() if st in ("update", "optimizer") and not ins}
    out["per_optimizer_step"] = sum(boundary.values()) / steps
    out["per_optimizer_step_by_kind"] = {k: v / steps for k, v in sorted(boundary.items(), key=lambda kv: -kv[1])}
    out["recompute_stage_end"] = sum(v for (st, ins, k), v in r0["counts"].items() if st == "recompute" and not ins)
    return out


def _rank_checked(rank, world_size, balancers, layers, out_path, tmp):
    import torch.distributed as dist

    result = {b: _summarize_checked({n: _run_checked(b, n, tmp) for n in layers}) for b in balancers}
    if rank == 0:
        Path(out_path).write_text(json.dumps(result, indent=1, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()


def census(balancers: list[str], out_path: str, layers=(1, 2), ranks: int = 2, inject=None, overrides=()) -> dict:
    """Run the census on ``ranks`` gloo ranks. With ``inject``, the last balancer runs once more with
    ``inject(trainer)`` applied first, as ``"<balancer>+injected"`` (tests: a sync put into a layer)."""
    from distributed_helpers import run_ranks

    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(_rank, ranks, list(balancers), list(layers), str(out_path), tmp, inject, list(overrides))
    return json.loads(Path(out_path).read_text())


def table_upload_bytes(ranks: list[int], model: str = "qwen3_30b_a3b", micro_steps: int = 8,
                       spare_slots: int = 2, ranks_per_node: int = 8) -> dict:
    """Bytes one rank uploads per micro-step for its tables (``PlacementRuntime.upload_tables``: every index
    its layers' dispatch and transfers read), at a model shape, on synthetic loads, foremoe plans."""
    import numpy as np

    from titan_foremoe.placement.tables import compile_micro_step, dispatch_arrays, stale_micro_steps
    from titan_foremoe.planner import PlannerConfig, Topology, plan_stage
    from titan_foremoe.planner.synthetic import MODEL_SHAPES, synthetic_loads
    from titan_foremoe.transfer.engine import TransferEngine

    out = {}
    E = MODEL_SHAPES[model].num_experts
    for R in ranks:
        if E % R:
            out[R] = f"skipped: {E} experts do not divide over {R} EP ranks (EP groups of <= {E})"
            continue
        loads = synthetic_loads(model, micro_steps, R, 4, 0)
        plan = plan_stage("foremoe", loads, Topology.from_ranks(R, min(ranks_per_node, R)),
                          PlannerConfig(spare_slots=spare_slots), micro_steps_per_step=4)
        stale_M, tr, rank = stale_micro_steps(micro_steps, 4), plan.transfers_T, R // 2
        sizes, t = [], None
        for m in range(micro_steps):
            t = compile_micro_step(plan.slots_MLRC[m], plan.assign_MLER[m], loads[m], rank, min(ranks_per_node, R),
                                   prev_slots_LRC=plan.slots_MLRC[m - 1] if m else None,
                                   moves_T=tr[tr["micro_step"] == m], stale=bool(stale_M[m]),
                                   prev_rows_LC=t.bank_row_LC if m else None)
            arrays = {}
            for lt in t.layers:
                arrays.update(TransferEngine.index_arrays(lt.transfers, lt.slot_source_C, E // R))
                arrays.update(dispatch_arrays(lt.dispatch))
            sizes.append(sum(-(-a.nbytes // 8) * 8 for a in arrays.values()))
        out[R] = {"bytes_per_microstep": int(np.median(sizes)), "arrays_per_microstep": len(arrays),
                  "layers": loads.shape[1]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--balancers", default="off,static,foremoe,reactive")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", default="1,2", help="two MoE layer counts n,n+1")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--activation-checkpoint", default="none", choices=["none", "full", "selective"],
                    help="[activation_checkpoint] mode: the update's backward recomputes the layers (counted in update)")
    ap.add_argument("--checked", action="store_true",
                    help="count under the checked backend ([debug] check_streams, full activation checkpointing): "
                    "also event/stream/device synchronizes and pageable moves, inside and outside the stages' "
                    "micro-steps (use --ranks 4: EP 2 with experts FSDP-sharded over 2)")
    ap.add_argument("--table-bytes", default="", help="instead: one rank's table upload per micro-step at "
                    "Qwen3-30B-A3B for these EP sizes (e.g. 64,128), no run")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.table_bytes:
        res = table_upload_bytes([int(r) for r in args.table_bytes.split(",")])
        Path(args.out, "table_bytes.json").write_text(json.dumps(res, indent=1))
        for R, r in res.items():
            if isinstance(r, str):
                print(f"R={R}: {r}")
            else:
                print(f"R={R}: {r['bytes_per_microstep'] / 2**20:.3f} MiB per micro-step per rank, "
                      f"{r['arrays_per_microstep']} arrays, one upload")
        return
    if args.checked:
        from distributed_helpers import run_ranks

        path = os.path.join(args.out, "census_checked.json")
        os.chdir(ROOT)
        with tempfile.TemporaryDirectory() as tmp:
            run_ranks(_rank_checked, args.ranks, args.balancers.split(","),
                      [int(x) for x in args.layers.split(",")], path, tmp)
        res = json.loads(Path(path).read_text())
        print(f"{'balancer':10s} {'recompute/layer':>16s} {'recompute/micro':>16s} {'update/layer':>13s} "
              f"{'update/micro':>13s} {'per optimizer step':>19s} {'recompute end':>14s}")
        print("(host syncs the checked backend saw, every kind: /layer: one more MoE layer per micro-step inside "
              "the stage's micro-steps; /micro: per micro-step inside them; then per optimizer step and per "
              "recompute stage outside them)")
        for b, r in res.items():
            print(f"{b:10s} {r['recompute']['per_moe_layer_per_micro_step']:16.2f} "
                  f"{r['recompute']['per_micro_step']:16.2f} {r['update']['per_moe_layer_per_micro_step']:13.2f} "
                  f"{r['update']['per_micro_step']:13.2f} {r['per_optimizer_step']:19.2f} "
                  f"{r['recompute_stage_end']:14d}")
        print(f"wrote {path}")
        return
    path = os.path.join(args.out, "census.json")
    res = census(args.balancers.split(","), path, tuple(int(x) for x in args.layers.split(",")), args.ranks,
                 overrides=[f"--activation_checkpoint.mode={args.activation_checkpoint}"])
    n0, n1 = res[next(iter(res))]["layers"]
    print(f"{'balancer':10s} {'decode/tok':>11s} {'rollout/fwd':>12s} {'rollout/layer':>14s} {'recompute/layer':>16s} "
          f"{'update/layer':>13s} {'optimizer/step':>15s}")
    print(f"(decode/tok: the decode loop per decoded token, whole model, {n1} layers; rollout/fwd: the whole rollout "
          f"(prefill, bookkeeping, scoring) per model forward at {n0} layers; /layer: one more MoE layer per forward "
          "or micro-step; optimizer: per optimizer step)")
    for b, r in res.items():
        s = r["stages"]
        print(f"{b:10s} {s['rollout'][f'decode_per_token_at_{n1}_layers']:11.2f} "
              f"{s['rollout'][f'per_unit_at_{n0}_layers']:12.2f} {s['rollout']['per_moe_layer_per_unit']:14.2f} "
              f"{s['recompute']['per_moe_layer_per_unit']:16.2f} "
              f"{s['update']['per_moe_layer_per_unit']:13.2f} {s['optimizer'][f'per_unit_at_{n0}_layers']:15.2f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
