"""The vLLM source: a live engine generates each step's rollouts from the policy's current weights.

Per RL step (every rank calls ``next_batch``; the collective parts are marked):

1. **weight sync** (collective): every rank writes its own slices of the policy
   into an HF folder (``export``: DCP's HF writer, experts in logical order),
   alternating between two folders so the engine never reads one being
   rewritten; then rank 0 has the engine ``reload_weights`` from it (or restarts
   a launched engine on it) and resets its prefix cache (cached blocks carry the
   old weights' KV and routes). The first step launches the engine on the first
   folder instead. With ``weight_sync = "nccl"`` (GPU) only that first launch
   uses a folder (a user-run engine: none); then trainer rank 0 joins the
   engine's NCCL transfer group and every sync broadcasts the HF-named tensors
   (``engines/vllm_weights.py``; every rank takes part in the gathers).
2. **probe** (collective): rank 0 asks the engine for the prompt log-probs and
   routes of a fixed probe sequence, every rank computes the trainer's on the
   same tokens with those routes replayed; a gap above ``probe_tolerance`` is
   an error (the engine is not serving these weights).
3. **generate**: each data-parallel rank sends its own prompts (``samples_per_prompt``
   samples per request, ``concurrency`` requests in flight), token ids in and
   out, with sampling log-probs and routed experts; every completion passes
   ``validate_sample`` (the file importer's checks) and the rows become a
   ``RolloutBatch`` exactly as in embedded mode.

Cost at R = 64 ranks (DP 64), Qwen3-30B-A3B: each rank's HTTP traffic is its
own rows only (its token ids out; back, per token 48 layers x 8 ids = 384 B of
uint8 routes + one log-prob), so no rank gathers the batch and the engine sees
64 clients x ``concurrency`` requests; the weight folder is 61 GB in bf16
(each rank writes ~1/64 of it) read once per step by the engine; two host
syncs per step (the two barriers around the reload), none per micro-step.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

import numpy as np

from ...distributed import collectives
from ..dump import dump_rows, write_dump
from ..engines.vllm_server import EngineError, LaunchSpec, VLLMClient, VLLMServer
from ..sample import ModelSpec, RolloutError, RolloutSample, validate_sample
from .base import RolloutBatch, rollout_of_samples, score

logger = logging.getLogger("titan_foremoe")


def _on_rank0(rank: int, fn):
    """``fn()`` on rank 0, its result (or its error, raised on every rank) broadcast: no rank waits forever."""
    got = None
    if rank == 0:
        try:
            got = ("ok", fn())
        except (EngineError, RolloutError, OSError) as e:
            got = ("error", f"{type(e).__name__}: {e}")
    kind, value = collectives.broadcast_object(got, src=0)  # also: no rank goes on before rank 0 is done
    if kind == "error":
        raise EngineError(value)
    return value


class VLLMSource:
    """Rollouts from a vLLM engine that gets the policy's weights every step (module docstring).

    ``sources/sglang.py`` reuses the engine-independent steps with its own server, client and config section."""

    engine_name = "vLLM"
    section = "rollout_engine"
    stream_sync = "nccl"
    """The ``weight_sync`` value that streams the weights to the engine (no folder after the launch)."""

    def __init__(self, cfg, *, prompts, tokenizer, task, reward_fn, spec: ModelSpec, export: Callable[[str], None],
                 policy_logprobs: Callable[[np.ndarray, np.ndarray], np.ndarray], rank: int, dp_rank: int,
                 math_exact: bool = False, weights: Callable[[], object] | None = None):
        self.cfg, self.eng = cfg, getattr(cfg, self.section)
        self.prompts, self.tokenizer, self.task, self.reward_fn = prompts, tokenizer, task, reward_fn
        self.spec, self.export, self.policy_logprobs = spec, export, policy_logprobs
        self.weights = weights  # nccl: () -> HFWeightStream of the policy (metadata() and a collective pass)
        self.sender = None  # nccl, rank 0: the NCCLWeightSender once the transfer group is joined
        self.rank, self.dp_rank, self.math_exact = rank, dp_rank, math_exact
        self.weights_dir = self.eng.weights_dir or os.path.join(cfg.job.dump_folder, "engine_weights")
        self.server: VLLMServer | None = None
        self.client: VLLMClient | None = None
        self.syncs = 0
        self.folder = ""
        self.restarts = 0
        self.timings: dict[str, float] = {}

    # -- engine lifetime --------------------------------------------------------------
    def _launch(self, folder: str) -> str:
        e = self.eng
        if self.server is None:
            os.makedirs(self.weights_dir, exist_ok=True)
            self.server = VLLMServer(LaunchSpec(
                python=os.path.expanduser(e.python), model=folder, dtype=e.dtype, max_model_len=e.max_model_len,
                extra_args=tuple(e.extra_args), log_path=os.path.join(self.weights_dir, "engine.log"),
                startup_timeout_s=e.startup_timeout_s,
                max_num_seqs=max(16, min(256, e.concurrency * self.cfg.rl.samples_per_prompt)),
                weight_transfer=e.weight_sync == "nccl",
            ))
        return self.server.start(folder)

    def _connect(self, url: str) -> None:
        self.client = VLLMClient(url, timeout_s=self.eng.request_timeout_s, retries=self.eng.retries,
                                 concurrency=self.eng.concurrency)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()

    def _restart(self, why: str) -> str:
        """Rank 0: restart a launched engine that died (within ``max_restarts``) on the folder being served; any
        other failure is raised as ``why``. Returns the engine's URL."""
        if (self.server is None or self.server.alive() or self.restarts >= self.eng.max_restarts
                or self.eng.weight_sync == self.stream_sync):  # a fresh engine would lack the group and weights
            raise EngineError(why)
        self.restarts += 1
        logger.warning("%s engine at %s died: restarting it on %s (%d of %d restarts)", self.engine_name,
                       self.client.url, self.folder, self.restarts, self.eng.max_restarts)
        self._connect(self._launch(self.folder))  # the folder being synced: the policy's current weights
        return self.client.url

    def _engine_call(self, fn):
        """Rank 0: ``fn(client)``; a launched engine that died is restarted and asked again."""
        try:
            return fn(self.client)
        except EngineError as e:
            self._restart(str(e))
            return fn(self.client)

    def _generate(self, requests: list[dict]) -> list:
        """Collective: this rank's requests answered. The engine may die while other ranks' requests are in
        flight, so recovery is decided together: if any rank's call failed, rank 0 restarts a dead engine (or
        raises every failing rank's error on every rank) and only the ranks that failed ask again. One all-reduce
        of a flag per step; the error strings are gathered only after a failure."""
        def attempt():
            try:
                return self.client.generate_many(requests), None
            except EngineError as e:
                return None, f"rank {self.rank}: {e}"

        groups, err = attempt()
        while collectives.any_true(err is not None):
            errors = "; ".join(e for e in collectives.all_gather_objects(err) if e)
            url = _on_rank0(self.rank, lambda: self._restart(errors))
            if self.client.url != url:
                self._connect(url)
            if err is not None:
                groups, err = attempt()
        return groups

    # -- 1. weight sync ------------------------------------------------------------------
    def sync_weights(self) -> None:
        """Collective: the engine serves the policy's current weights (launched on them the first time)."""
        t0 = time.perf_counter()
        if self.eng.weight_sync == self.stream_sync and (self.syncs > 0 or self.eng.url):
            return self._sync_nccl(t0)
        folder = self.folder = os.path.join(self.weights_dir, f"policy_{self.syncs % 2}")
        self.export(folder)  # every rank its own slices; ends with a barrier
        t1 = time.perf_counter()
        url = _on_rank0(self.rank, lambda: self._sync_rank0(folder))
        if self.client is None or self.client.url != url:
            self._connect(url)
        self.syncs += 1
        self.timings.update({"rollout/weight_export_s": t1 - t0, "rollout/weight_load_s": time.perf_counter() - t1})

    def _sync_nccl(self, t0: float) -> None:
        """Collective: rank 0 broadcasts the policy to the engine (joining its transfer group the first time);
        every rank iterates the stream (its gathers); rank 0's outcome is broadcast so every rank raises its
        error."""
        stream = self.weights()
        meta = stream.metadata()  # local: global shapes, nothing gathered
        pairs = iter(stream)  # one pass per rank per sync (each element a collective gather)
        status = None
        if self.rank == 0:
            try:
                if self.client is None:
                    self._connect(self.eng.url)
                if self.sender is None:
                    self.sender = self._new_sender()
                    self.sender.init()
                self.sender.send(meta, pairs)
                status = ("ok", self.client.url)
            except Exception as e:  # any error: every rank raises it, after the gathers the others are in
                status = ("error", f"{type(e).__name__}: {e}")
        if status is None or status[0] == "error":
            for _ in pairs:  # the gathers rank 0's broadcasts are made of (a no-op once drawn)
                pass
        kind, value = collectives.broadcast_object(status, src=0)
        if kind == "error":
            raise EngineError(value)
        if self.client is None or self.client.url != value:
            self._connect(value)
        self.syncs += 1
        self.timings.update({"rollout/weight_export_s": 0.0, "rollout/weight_load_s": time.perf_counter() - t0})

    def _new_sender(self):
        """Rank 0: the weight sender of ``stream_sync``, posting through the client with one attempt per call (the
        engine may still be inside NCCL)."""
        from ..engines.vllm_server import free_port
        from ..engines.vllm_weights import NCCLWeightSender

        client = self.client
        return NCCLWeightSender(lambda path, body: client.post(path, body, retry=False),
                                master_address=self.eng.nccl_address, master_port=free_port(),
                                engine_workers=self.eng.engine_workers)

    def _sync_rank0(self, folder: str) -> str:
        """Rank 0: launch, restart or reload the engine on ``folder``; returns its URL."""
        if self.client is None and not self.eng.url:
            return self._launch(folder)
        if self.client is None:
            self._connect(self.eng.url)
        elif self.server is not None and self.eng.weight_sync == "restart":
            return self._launch(folder)
        self._engine_call(lambda c: c.reload_weights(folder))
        self._engine_call(lambda c: c.reset_prefix_cache())
        return self.client.url

    # -- 2. probe ------------------------------------------------------------------------------
    def probe(self, token_ids: list[int]) -> float:
        """Collective: max |engine - trainer| log-prob over ``token_ids`` (rank 0's request, every rank's forward)."""
        token_ids, lp, routes, url = _on_rank0(
            self.rank, lambda: (token_ids, *self._engine_call(lambda c: c.prompt_logprobs(token_ids)), self.client.url))
        if self.client.url != url:  # rank 0 restarted a dead engine during the probe
            self._connect(url)
        ours = self.policy_logprobs(np.asarray(token_ids, np.int64), routes[: len(token_ids) - 1])
        gap = float(np.abs(ours - lp).max())
        if not gap <= self.eng.probe_tolerance:
            raise EngineError(f"{self.engine_name} at {self.client.url}: probe log-probs differ from the trainer's "
                              f"by {gap:.3g} (> [{self.section}] probe_tolerance {self.eng.probe_tolerance}) after "
                              f"weight sync {self.syncs}: the engine is not serving the policy's weights")
        return gap

    # -- 3. generate ---------------------------------------------------------------------------
    def next_batch(self, step: int) -> RolloutBatch:
        rl = self.cfg.rl
        examples, prompts = self.prompts.prompts(step)
        self.sync_weights()
        t0 = time.perf_counter()
        gap = self.probe(prompts[0])  # rank 0's first prompt (sent to every rank): the probe of this step
        t1 = time.perf_counter()
        spp = rl.samples_per_prompt
        requests = [dict(prompt_ids=p, n=spp, max_tokens=rl.max_new_tokens, temperature=rl.temperature,
                         top_p=rl.top_p, seed=(self.cfg.job.seed * 1_000_003 + step * 65_537 + self.dp_rank * 4099
                                               + i * spp) % 2**31)  # sample j: seed + j
                    for i, p in enumerate(prompts)]
        groups = self._generate(requests)
        t2 = time.perf_counter()
        samples = []
        url = self.client.url
        for i, (p, group) in enumerate(zip(prompts, groups)):
            for j, c in enumerate(group):
                tokens = np.asarray([*p, *c.token_ids], np.int64)
                lp = np.full(len(tokens), np.nan, np.float32)
                if len(c.logprobs) != len(c.token_ids):
                    raise RolloutError(f"{self.engine_name} at {url} step {step} prompt {i} sample {j}", "logprobs",
                                       f"{len(c.logprobs)} for {len(c.token_ids)} generated tokens")
                lp[len(p):] = c.logprobs
                s = RolloutSample(tokens, len(p), c.routes_RXK, lp)
                validate_sample(s, self.spec, f"{self.engine_name} at {url} step {step} prompt {i} sample {j}")
                s.routes_RXK = s.routes_RXK.astype(np.int64)
                samples.append(s)
        rollout = rollout_of_samples(samples, pad_id=self.tokenizer.pad_id, eos_ids=self.tokenizer.eos_ids,
                                     num_experts=self.spec.num_experts)
        rows = [ex for ex in examples for _ in range(spp)]
        completions = [self.tokenizer.decode(rollout.completion(b)) for b in range(len(rows))]
        rewards, exact = score(self.reward_fn, self.task, rows, completions, math_exact=self.math_exact,
                               format_reward=rl.format_reward)
        if rl.dump_rollouts:
            self._dump(step, rollout, rows, completions, rewards, samples)
        self.timings.update({"rollout/probe_s": t1 - t0, "rollout/generate_s": t2 - t1, "rollout/probe_gap": gap,
                             "rollout/engine_restarts": float(self.restarts),
                             "rollout/engine_starts": float(self.server.starts if self.server is not None else 0)})
        return RolloutBatch(rollout, rewards, exact)

    def _dump(self, step, rollout, rows, completions, rewards, samples) -> None:
        """The step's rows (as embedded mode dumps them) plus the engine's own routes, per rank."""
        folder = os.path.join(self.cfg.job.dump_folder, "rollouts")
        write_dump(folder, step, dump_rows(step, self.dp_rank, rollout, rows, completions, rewards))
        os.makedirs(folder, exist_ok=True)
        np.savez(os.path.join(folder, f"engine_routes_{step:05d}_rank{self.dp_rank:04d}.npz"),
                 routes_NXK=np.concatenate([s.routes_RXK for s in samples]),
                 routed_N=np.array([len(s.routes_RXK) for s in samples]))

    def state_dict(self) -> dict:
        return {}  # prompts and sampling seeds are functions of (seed, step, rank)

    def load_state_dict(self, state: dict) -> None:
        pass
