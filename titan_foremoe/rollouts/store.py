"""The rollout directory the trainer reads: sharded ``.npy`` columns plus ``index.json``.

Layout (N rows in a shard, S = its total tokens, R = S - N routed positions)::

    index.json                 model shape, route dtype, row count, one entry per shard
    shard_00000/tokens.npy     int32 [S]       all rows' tokens, concatenated
    shard_00000/offsets.npy    int64 [N + 1]   row i is tokens[offsets[i]:offsets[i+1]]
    shard_00000/prompt_lens.npy int32 [N]
    shard_00000/groups.npy     int64 [N]       GRPO group id (samples of one prompt share it)
    shard_00000/routes.npy     uint8|int16 [R, layers, top_k]; row i is routes[offsets[i]-i : offsets[i+1]-i-1]
    shard_00000/no_route.npy   uint8 [R, layers]  1 where the engine sent no route (-1), when any row has one
    shard_00000/logprobs.npy   float32 [S]     behaviour log-probs (NaN on the prompt), when the engine gave them
    shard_00000/rewards.npy    float32 [N]     NaN where absent (then computed from the answer)
    shard_00000/answers.json   list[str | null]

Every column is opened memory-mapped, so a rank that reads its rows touches only
their byte ranges: routes cost ``layers x top_k x itemsize`` bytes per token
(Qwen3-30B-A3B: 48 x 8 x 1 = 384 B).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..routing_log import route_dtype
from .sample import NO_ROUTE, ModelSpec, RolloutSample

VERSION = 1


def route_np_dtype(num_experts: int) -> np.dtype:
    return np.dtype(np.uint8) if str(route_dtype(num_experts)) == "torch.uint8" else np.dtype(np.int16)


class RolloutWriter:
    """Append validated samples; ``close()`` writes the last shard and the index."""

    def __init__(self, out_dir: str | Path, spec: ModelSpec, rows_per_shard: int = 4096, source: dict | None = None):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if (self.out / "index.json").exists():
            raise FileExistsError(f"{self.out} already holds a rollout directory (index.json)")
        self.spec, self.rows_per_shard, self.source = spec, rows_per_shard, source or {}
        self.dtype = route_np_dtype(spec.num_experts)
        self.shards: list[dict] = []
        self.rows = 0
        self._buf: list[tuple[RolloutSample, int]] = []
        self.has = {"logprobs": False, "rewards": False, "answers": False, "loss_mask": False,
                    "no_route": False}

    def add(self, s: RolloutSample, group: int) -> None:
        self._buf.append((s, group))
        self.rows += 1
        if len(self._buf) >= self.rows_per_shard:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        name = f"shard_{len(self.shards):05d}"
        d = self.out / name
        d.mkdir()
        samples = [s for s, _ in self._buf]
        lengths = np.array([len(s.tokens_T) for s in samples], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)])
        np.save(d / "tokens.npy", np.concatenate([s.tokens_T for s in samples]).astype(np.int32))
        np.save(d / "offsets.npy", offsets)
        np.save(d / "prompt_lens.npy", np.array([s.prompt_len for s in samples], dtype=np.int32))
        np.save(d / "groups.npy", np.array([g for _, g in self._buf], dtype=np.int64))
        routes_RXK = np.concatenate([np.asarray(s.routes_RXK) for s in samples])
        if np.issubdtype(routes_RXK.dtype, np.signedinteger) and (routes_RXK == NO_ROUTE).any():
            hole_RX = (routes_RXK == NO_ROUTE).all(-1)  # validated: all K entries or none
            self.has["no_route"] = True
            np.save(d / "no_route.npy", hole_RX.astype(np.uint8))  # the routes column holds 0 there
            routes_RXK = np.where(hole_RX[..., None], 0, routes_RXK)
        np.save(d / "routes.npy", routes_RXK.astype(self.dtype))
        if any(s.logprobs_T is not None for s in samples):
            self.has["logprobs"] = True
        lp = [s.logprobs_T if s.logprobs_T is not None else np.full(len(s.tokens_T), np.nan, np.float32)
              for s in samples]
        np.save(d / "logprobs.npy", np.concatenate(lp).astype(np.float32))
        if any(s.loss_mask_T is not None for s in samples):  # a shard without the file trains every completion token
            self.has["loss_mask"] = True
            np.save(d / "loss_mask.npy", np.concatenate([
                s.loss_mask_T if s.loss_mask_T is not None else np.arange(len(s.tokens_T)) >= s.prompt_len
                for s in samples]).astype(np.uint8))
        rewards = np.array([np.nan if s.reward is None else s.reward for s in samples], dtype=np.float32)
        self.has["rewards"] |= bool(np.isfinite(rewards).any())
        np.save(d / "rewards.npy", rewards)
        answers = [s.answer for s in samples]
        self.has["answers"] |= any(a is not None for a in answers)
        (d / "answers.json").write_text(json.dumps(answers))
        self.shards.append({"dir": name, "first_row": self.rows - len(samples), "rows": len(samples),
                            "tokens": int(offsets[-1]), "max_len": int(lengths.max())})
        self._buf = []

    def close(self, **stats) -> dict:
        self._flush()
        s = self.spec
        index = {
            "version": VERSION, "rows": self.rows, "num_layers": s.num_layers, "top_k": s.top_k,
            "num_experts": s.num_experts, "vocab_size": s.vocab_size, "route_dtype": self.dtype.name,
            "route_bytes_per_token": s.num_layers * s.top_k * self.dtype.itemsize,
            "max_len": max((sh["max_len"] for sh in self.shards), default=0), **{f"has_{k}": v for k, v in self.has.items()},
            "source": self.source, **stats, "shards": self.shards,
        }
        tmp = self.out / "index.json.tmp"
        tmp.write_text(json.dumps(index, indent=1))
        os.replace(tmp, self.out / "index.json")
        return index


@dataclass
class RolloutRow:
    """One stored row, as the trainer reads it."""

    tokens_T: np.ndarray  # int64
    prompt_len: int
    routes_RXK: np.ndarray  # uint8 / int16; int64 with -1 (no route) when the shard has ``no_route.npy``
    logprobs_T: np.ndarray  # float32, NaN where unknown
    reward: float  # NaN where absent
    answer: str | None
    group: int
    loss_mask_T: np.ndarray | None = None  # bool; None: every completion token is trained


def _load_column(path: Path) -> np.ndarray:
    """A memory-mapped column; a damaged ``.npy`` header names its file (a missing file stays an OSError)."""
    try:
        return np.load(path, mmap_mode="r")
    except (ValueError, EOFError) as e:
        raise ValueError(f"{path}: damaged .npy ({type(e).__name__}: {e})") from None


class RolloutStore:
    """Read rows of a rollout directory; columns are memory-mapped, so only the rows read are touched."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index_path = self.path / "index.json"
        if not index_path.is_file():
            raise FileNotFoundError(f"{self.path}: no index.json (not a rollout directory; see "
                                    "`python -m titan_foremoe.rollouts import --help`)")
        try:
            self.index = json.loads(index_path.read_text())
            if not isinstance(self.index, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise ValueError(f"{index_path}: damaged ({type(e).__name__}: {e})") from None
        if self.index.get("version") != VERSION:
            raise ValueError(f"{index_path}: version {self.index.get('version')}, this trainer reads {VERSION}")
        try:
            self.rows = int(self.index["rows"])
            self._starts = np.array([sh["first_row"] for sh in self.index["shards"]], dtype=np.int64)
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{index_path}: damaged (bad or missing {e})") from None
        self._cols: dict[int, dict] = {}

    def spec(self) -> ModelSpec:
        i = self.index
        return ModelSpec(i["num_layers"], i["top_k"], i["num_experts"], i.get("vocab_size"))

    def _shard(self, k: int) -> dict:
        if k not in self._cols:
            d = self.path / self.index["shards"][k]["dir"]
            cols = {n: _load_column(d / f"{n}.npy")
                    for n in ("tokens", "offsets", "prompt_lens", "groups", "routes", "logprobs", "rewards")}
            cols["loss_mask"] = np.load(d / "loss_mask.npy", mmap_mode="r") if (d / "loss_mask.npy").is_file() else None
            cols["no_route"] = np.load(d / "no_route.npy", mmap_mode="r") if (d / "no_route.npy").is_file() else None
            cols["answers"] = None
            cols["dir"] = d
            r, want = cols["routes"], (self.index["num_layers"], self.index["top_k"])
            if r.ndim != 3 or tuple(r.shape[1:]) != want or not np.issubdtype(r.dtype, np.integer):
                raise ValueError(f"{d / 'routes.npy'}: shape {list(r.shape)} dtype {r.dtype}, the import wrote "
                                 f"[positions, {want[0]}, {want[1]}] integers (edited after import? import again)")
            self._cols[k] = cols
        return self._cols[k]

    def _locate(self, row: int) -> tuple[dict, int]:
        if not 0 <= row < self.rows:
            raise IndexError(f"row {row} out of range: {self.path} holds {self.rows} rows")
        k = int(np.searchsorted(self._starts, row, side="right") - 1)
        return self._shard(k), row - int(self._starts[k])

    def length(self, row: int) -> int:
        c, i = self._locate(row)
        return int(c["offsets"][i + 1] - c["offsets"][i])

    def lengths(self, rows: range) -> np.ndarray:
        """Token counts of ``rows`` from the offsets alone (no tokens read), shard by shard."""
        out = [np.zeros(0, dtype=np.int64)]
        if len(rows) == 0:
            return out[0]
        k0 = max(int(np.searchsorted(self._starts, rows.start, side="right")) - 1, 0)
        k1 = int(np.searchsorted(self._starts, rows.stop - 1, side="right"))
        for k in range(k0, k1):  # only the shards the rows fall in
            sh = self.index["shards"][k]
            a, b = max(rows.start, sh["first_row"]), min(rows.stop, sh["first_row"] + sh["rows"])
            if a < b:
                out.append(np.diff(self._shard(k)["offsets"][a - sh["first_row"] : b - sh["first_row"] + 1]))
        return np.concatenate(out)

    def read(self, row: int) -> RolloutRow:
        c, i = self._locate(row)
        try:
            return self._read(c, i)
        except (ValueError, IndexError, TypeError, OSError) as e:  # offsets or columns that do not fit
            raise ValueError(f"{c['dir']}: row {row} is damaged ({type(e).__name__}: {e})") from None

    def _read(self, c: dict, i: int) -> RolloutRow:
        a, b = int(c["offsets"][i]), int(c["offsets"][i + 1])
        if not 0 <= a < b <= len(c["tokens"]):
            raise ValueError(f"offsets.npy gives tokens [{a}, {b}) of {len(c['tokens'])}")
        if c["answers"] is None:
            c["answers"] = json.loads((c["dir"] / "answers.json").read_text())
        routes_RXK = np.array(c["routes"][a - i : b - i - 1])
        if routes_RXK.size and (routes_RXK.min() < 0 or routes_RXK.max() >= self.index["num_experts"]):
            raise ValueError(f"{c['dir'] / 'routes.npy'} holds expert id {int(routes_RXK.max())} (min "
                             f"{int(routes_RXK.min())}), outside [0, {self.index['num_experts']}): edited after "
                             "import? import again")
        if c["no_route"] is not None:
            hole_RX = np.asarray(c["no_route"][a - i : b - i - 1], dtype=bool)
            if hole_RX.any():
                routes_RXK = np.where(hole_RX[..., None], NO_ROUTE, routes_RXK.astype(np.int64))
        return RolloutRow(
            tokens_T=np.asarray(c["tokens"][a:b], dtype=np.int64),
            prompt_len=int(c["prompt_lens"][i]),
            routes_RXK=routes_RXK,
            logprobs_T=np.array(c["logprobs"][a:b]),
            reward=float(c["rewards"][i]),
            answer=c["answers"][i],
            group=int(c["groups"][i]),
            loss_mask_T=None if c["loss_mask"] is None else np.asarray(c["loss_mask"][a:b], dtype=bool),
        )
