"""The engine fleet's cost per rank and per step at the real size (issue 44, item 6): Qwen3-30B-A3B at 64 / 256 /
1024 GPUs, colocated (an engine per node, sleep level 1) and disaggregated (a quarter of the GPUs train, engines of
one node on the rest, the 16 + 48 proportion).

    python benchmarks/fleet_cost.py [--gpus 64,256,1024] [--rows-per-rank 32] [--samples-per-prompt 16] \\
        [--prompt-tokens 256] [--mean-response 2000] [--max-tokens 4096] [--markdown] [--json OUT]

Per rank and step:
* the fleet client (``rollouts/fleet/dealing.py``): its requests (a prompt with its samples, dealt whole; HTTP
  requests: one per sample, as the runtime posts them), its prompts' token ids out, per generated token 48 layers x
  8 routes (uint8) + its log-prob (fp32) + the token id (int32) back (raw bytes; JSON / base64 adds a third), and
  the step's one all-gather of the request estimates (G int64 to every rank);
* the sync (``sync_cost``): bytes into the busiest rank, out of / into the busiest trainer NIC; colocated a gather
  on every node (``colocated_ipc_cost``: every rank all-gathers each entry, its slice out once per other node), disaggregated ``fleet_sync_cost`` of one transfer
  group (recommended) and of per-engine groups;
* sleep level 1's host memory per node (each engine's weights once: M per engine of the node);
* one engine's failover (modelled): detect (connection refused: the next request or health poll, ``--poll-s``; a
  hang: ``fleet/hang.py``'s ``detect_s`` of ``[rollout_engine] hang_timeout_s``, ``--hang-timeout-s``), re-deal
  (``dealing.deal`` of the lost requests over the survivors from their loads, **timed here**), re-prefill the lost prompts on the survivors (``rollout.prefill_ms``), and the
  step's worst extension: regenerating a lost response of ``--max-tokens`` from its start at a survivor's full
  batch (``rollout.decode_step_ms``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from titan_foremoe.rollouts.engines.sync_cost import (FleetSync, SyncLinks, SyncSetting, colocated_ipc_cost,  # noqa: E402
                                                      expert_tensor_count, fleet_sync_cost, hf_tensor_bytes)
from titan_foremoe.rollouts.fleet.dealing import deal, request_tokens  # noqa: E402
from titan_foremoe.rollouts.fleet.hang import detect_s  # noqa: E402
from titan_foremoe.rollouts.fleet.layout import engine_layout  # noqa: E402
from titan_foremoe.simulator.calibration import load_calibration  # noqa: E402
from titan_foremoe.simulator.models import get_model  # noqa: E402
from titan_foremoe.simulator.rollout import decode_step_ms, kv_seqs, prefill_ms  # noqa: E402
from titan_foremoe.simulator.simulate import device_costs  # noqa: E402

N_PER_NODE = 8


def client_bytes(rows: int, samples: int, prompt: int, mean_response: float, ranks: int, model) -> dict:
    """A rank's fleet client per step (module docstring)."""
    prompts = rows // samples
    back_per_token = model.moe_layers * model.top_k * 1 + 4 + 4
    return {"requests_dealt": prompts, "http_requests": rows, "bytes_out": rows * prompt * 4,
            "bytes_back": rows * mean_response * back_per_token, "allgather_bytes_in": prompts * ranks * 8}


def failover(layout, rows: int, samples: int, prompt: int, max_tokens: int, model, cal, link, poll_s: float,
             timeout_s: float) -> dict:
    """One engine of ``layout`` lost mid-step (module docstring)."""
    K, g = layout.count, layout.engines[0].gpus
    G = rows // samples * layout.trainer_gpus
    est = request_tokens(np.full(G, prompt), samples, max_tokens)
    alive = np.ones(K, bool)
    eng = deal(est, alive)
    lost = eng == 0
    alive[0] = False
    load = np.bincount(eng[~lost], weights=est[~lost], minlength=K).astype(np.int64)
    t0 = time.perf_counter()
    for _ in range(5):
        again = deal(est[lost], alive, load)
    redeal_ms = (time.perf_counter() - t0) / 5 * 1e3
    per_survivor = int(np.bincount(again, minlength=K).max())
    prefill = prefill_ms(model, link, per_survivor, prompt, g)  # the prompt once per request (shared prefix)
    hbm = cal.hbm_GBps * 1e9
    b = min(1024, kv_seqs(model, cal, g, prompt + max_tokens))  # a survivor's full batch (max_num_seqs, its KV cache)
    step = sum(decode_step_ms(model, cal, link, b, prompt + max_tokens / 2, g, hbm).values())
    return {"lost_requests": int(lost.sum()), "lost_samples": int(lost.sum()) * samples,
            "requests_per_survivor": per_survivor, "detect_refused_s": poll_s, "detect_hang_s": timeout_s,
            "redeal_ms": redeal_ms, "reprefill_ms": prefill, "regenerate_worst_s": max_tokens * step / 1e3}


def sync_rows(layout, model, links, M: float) -> dict:
    sizes = hf_tensor_bytes(model, 2)
    kw = dict(state_entries=12 * model.num_layers + 3, expert_tensors=expert_tensor_count(model), load="stacked")
    T = layout.trainer_gpus
    if layout.colocated:
        r = colocated_ipc_cost(sizes, SyncSetting("bucketed", T, 0, layout.engines[0].gpus, N_PER_NODE, **kw),
                               links)
        remote = M * max(T - N_PER_NODE, 0) / T
        return {"ipc per node": {"sync_s": r["sync_s"], "rank_in": r["bytes_received_per_rank"],
                                 "nic_out": M / T * max(T // N_PER_NODE - 1, 0), "nic_in": remote / N_PER_NODE}}
    out = {}
    for design in ("one_group", "per_engine"):
        r = fleet_sync_cost(sizes, FleetSync.of(layout, design, **kw), links)
        out[design] = {"sync_s": r["sync_s"], "rank_in": r["bytes_received_per_rank"], "nic_out": r["nic_out_bytes"],
                       "nic_in": r["nic_in_bytes"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", default="64,256,1024")
    ap.add_argument("--rows-per-rank", type=int, default=32,
                    help="rollout rows per GPU of the job per step (the 64-GPU config: 2,048 rows; disaggregated, the "
                         "same rows over the trainer's ranks: 128 per rank at 16 + 48, the 16 + 48 config's)")
    ap.add_argument("--samples-per-prompt", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--mean-response", type=float, default=2000.0)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--poll-s", type=float, default=1.0, help="health poll / next request after a refusal (assumed)")
    ap.add_argument("--hang-timeout-s", type=float, default=60.0, help="[rollout_engine] hang_timeout_s (default)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", default="")
    a = ap.parse_args(argv)
    if a.rows_per_rank % a.samples_per_prompt:
        ap.error(f"--rows-per-rank {a.rows_per_rank} is not whole prompts of {a.samples_per_prompt} samples")
    model = get_model("qwen3_30b_a3b")
    cal = load_calibration(None)
    link = device_costs(cal)
    links = SyncLinks.of(link)
    M = float(hf_tensor_bytes(model, 2).sum())
    rows = []
    for R in [int(x) for x in a.gpus.split(",") if x]:
        for placement in ("colocated", "disaggregated"):
            if placement == "colocated":
                lay = engine_layout(trainer_gpus=R, gpus_per_node=N_PER_NODE, engines=0, gpus_per_engine=N_PER_NODE,
                                    colocated=True)
            else:
                lay = engine_layout(trainer_gpus=R // 4, gpus_per_node=N_PER_NODE, engines=3 * R // 4 // N_PER_NODE,
                                    gpus_per_engine=N_PER_NODE, colocated=False)
            T = lay.trainer_gpus
            rows_rank = a.rows_per_rank * R // T  # the step's rows over the trainer's ranks
            row = {"gpus": R, "placement": placement, "trainer_gpus": T, "engines": lay.count,
                   "rows_per_rank": rows_rank,
                   "client": client_bytes(rows_rank, a.samples_per_prompt, a.prompt_tokens, a.mean_response, T,
                                          model),
                   "sync": sync_rows(lay, model, links, M),
                   "sleep1_host_bytes_per_node": M * (N_PER_NODE // lay.engines[0].gpus) if lay.colocated else 0.0,
                   "failover": failover(lay, rows_rank, a.samples_per_prompt, a.prompt_tokens, a.max_tokens,
                                        model, cal, link, a.poll_s, detect_s(a.hang_timeout_s))}
            rows.append(row)
            c, f = row["client"], row["failover"]
            sync = "; ".join(f"{d} {s['sync_s']:.2f} s, rank in {s['rank_in'] / 1e9:.1f} GB, NIC out "
                             f"{s['nic_out'] / (M / 8):.2f} / in {s['nic_in'] / (M / 8):.2f} x M/8"
                             for d, s in row["sync"].items())
            print(f"{R:5d} GPUs {placement:13s} {T:4d} trainer, {lay.count:3d} engines | client: {c['requests_dealt']} "
                  f"requests ({c['http_requests']} HTTP), out {c['bytes_out'] / 1e3:.0f} KB, back "
                  f"{c['bytes_back'] / 1e6:.1f} MB, all-gather {c['allgather_bytes_in'] / 1e3:.1f} KB | sync: {sync} | "
                  f"sleep-1 host {row['sleep1_host_bytes_per_node'] / 1e9:.0f} GB/node | failover: "
                  f"{f['lost_requests']} requests lost, re-deal {f['redeal_ms']:.2f} ms, re-prefill "
                  f"{f['reprefill_ms']:.0f} ms, worst regenerate {f['regenerate_worst_s']:.0f} s")
    loop = time.time()
    s = 0
    for i in range(3_000_000):
        s += i
    loop = time.time() - loop
    print(f"3M-addition Python loop here: {loop:.2f} s (the re-deal times are this machine's)")
    if a.markdown:
        for r in rows:
            c, f = r["client"], r["failover"]
            for d, s_ in r["sync"].items():
                print(f"| {r['gpus']} | {r['placement']} ({r['trainer_gpus']} trainer, {r['engines']} engines) | "
                      f"{c['requests_dealt']} / {c['http_requests']} | {c['bytes_out'] / 1e3:.0f} KB / "
                      f"{c['bytes_back'] / 1e6:.1f} MB / {c['allgather_bytes_in'] / 1e3:.1f} KB | {d}: "
                      f"{s_['sync_s']:.2f} s, {s_['rank_in'] / 1e9:.1f} GB, {s_['nic_out'] / (M / 8):.2f} / "
                      f"{s_['nic_in'] / (M / 8):.2f} | {r['sleep1_host_bytes_per_node'] / 1e9:.0f} GB | "
                      f"{f['lost_requests']} lost; {f['redeal_ms']:.2f} ms + {f['reprefill_ms']:.0f} ms; "
                      f"<= {f['regenerate_worst_s']:.0f} s |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"model_bytes": M, "args": vars(a), "loop_s": loop, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
