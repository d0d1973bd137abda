"""Pre-flight checks that need the file system, run before torchrun starts (and again in every worker).

- every output folder (``dump_folder``, checkpoints, TensorBoard, loads, the vLLM weight folders) can be
  created and written, and a launched vLLM engine's interpreter finds vLLM and the CPU route-capture plugin;
- the latest complete checkpoint can serve this job: it is a full checkpoint (not a
  ``last_save_model_only`` export) and holds the state this config needs (a KL reference
  when ``kl_coef > 0``); ``JobFinished`` when it already covers every step.

A checkpoint is complete when its ``step-N`` folder holds DCP's ``.metadata``: saves write ``step-N.saving`` and
rename it to ``step-N`` once complete (``train/checkpoints.py``), and DCP writes ``.metadata`` last
(``FileSystemWriter.finish``), so a save interrupted mid-way is never loaded. ``latest_complete_step`` is the one
rule: torchtitan's load (``AtomicCheckpointManager._find_load_step``), this pre-flight and the launcher's stop line
use it. The step to load is verified against the checksums its save recorded (``checksums.py``).
"""

from __future__ import annotations

import os
import re
import tempfile

from .job_config import JobConfig
from .loader import ConfigError


class JobFinished(Exception):
    """The latest checkpoint already covers every step of the job (the message says so)."""


def job_steps(cfg: JobConfig) -> int:
    """Steps of the whole job (the ``step-N`` of its last checkpoint)."""
    return cfg.training.steps + (cfg.rl.sft_warmup_steps if cfg.rl.enable else 0)


def checkpoint_folder(cfg: JobConfig) -> str:
    return os.path.join(cfg.job.dump_folder, cfg.checkpoint.folder)


def latest_complete_step(folder: str) -> int:
    """The highest ``step-N`` in ``folder`` with DCP ``.metadata`` (torchtitan's rule), -1 if none."""
    if not os.path.isdir(folder):
        return -1
    steps = [
        int(m.group(1))
        for name in os.listdir(folder)
        if (m := re.fullmatch(r"step-(\d+)", name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))
    ]
    return max(steps, default=-1)


def latest_hf_export_step(folder: str) -> int | None:
    """The newest ``step-N`` if it is a model-only HF export (``model.safetensors.index.json``, no DCP
    ``.metadata``; what ``last_save_in_hf`` writes at the end), else None.

    torchtitan counts such a folder as a checkpoint to resume from, then reads it as DCP and fails; a
    folder with neither file is an interrupted save, which torchtitan (and ``latest_complete_step``) skip.
    """
    if not os.path.isdir(folder):
        return None
    steps = [int(m.group(1)) for name in os.listdir(folder) if (m := re.fullmatch(r"step-(\d+)", name))]
    steps = [s for s in steps if os.path.isdir(os.path.join(folder, f"step-{s}"))]
    if not steps:
        return None
    path = os.path.join(folder, f"step-{max(steps)}")
    hf = os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    return max(steps) if hf and not os.path.isfile(os.path.join(path, ".metadata")) else None


def checkpoint_keys(path: str) -> set[str]:
    """The flattened state-dict keys a DCP checkpoint holds (``train_state.step``, ``job_state...``)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return set(FileSystemReader(path).read_metadata().state_dict_metadata)
    except Exception as e:  # a corrupt or foreign .metadata
        raise ConfigError(f"[checkpoint] folder: cannot read {path}/.metadata ({type(e).__name__}: {e})") from None


_NOT_MODEL = ("optimizer.", "train_state.", "job_state.", "dataloader", "lr_scheduler.")


def checked_model_args(cfg: JobConfig):
    """The model args the workers build (the char tokenizer's vocabulary without an HF folder)."""
    from .validate import model_args

    vocab = None
    if not cfg.model.hf_assets_path:
        from ..data.tokenizer import CharTokenizer

        vocab = CharTokenizer().vocab_size
    return model_args(cfg, vocab_size=vocab)


def expected_shapes(cfg: JobConfig, args=None) -> dict[str, tuple[int, ...]]:
    """Every tensor this config's model saves, with its full (unsharded) shape.

    Built on the meta device: no memory, 0.13 s for debug_tiny (the 48-layer model builds the same
    modules, no weights). The balancer's saved loads are (layers, experts) too."""
    import torch

    from ..models.build import build_model_config

    args = args if args is not None else checked_model_args(cfg)
    with torch.device("meta"):
        model = build_model_config(args, expert_dtype=cfg.model.expert_dtype).build()
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes["job_state.balancer_history.loads_LE"] = (args.n_layers, args.num_experts)
    return shapes


# Model facts a resume must keep, saved beside each checkpoint: DCP's .metadata holds tensor shapes only, so
# a top_k (or score function, head count at equal width...) change would load silently. Not rope_theta or
# max_seq_len: changing those on a resume is a choice (context extension), not a mismatch.
MODEL_FACTS_FILE = "model_facts.json"
MODEL_FACT_KEYS = ("n_layers", "dim", "n_heads", "n_kv_heads", "head_dim", "vocab_size", "moe_hidden_dim",
                   "num_experts", "top_k", "shared_expert_hidden_dim", "score_func", "route_norm")
_FACT_CONFIG_KEY = {k: f"[model] {k}" for k in ("n_layers", "dim", "num_experts", "top_k", "moe_hidden_dim",
                                                 "shared_expert_hidden_dim")}


def model_facts(args) -> dict[str, object]:
    """``MODEL_FACT_KEYS`` of a model's args (a ``MoEModelArgs``)."""
    return {k: getattr(args, k) for k in MODEL_FACT_KEYS}


def write_model_facts(step_folder: str, facts: dict[str, object], dataset: dict[str, object] | None = None) -> None:
    """``step-N/model_facts.json``, written before DCP writes the step (whose ``.metadata`` comes last), so
    every complete checkpoint saved by this code has it; checkpoints from before it simply lack the file.
    ``dataset``: the prompt file's ``dataset_facts`` (a resume on another file is refused, ``dataset_problem``)."""
    import json

    os.makedirs(step_folder, exist_ok=True)
    tmp = os.path.join(step_folder, MODEL_FACTS_FILE + ".tmp")
    with open(tmp, "w") as f:
        json.dump({"version": 1, "model": facts, **({"dataset": dataset} if dataset else {})}, f, indent=1)
    os.replace(tmp, os.path.join(step_folder, MODEL_FACTS_FILE))


def facts_problem(path: str, facts: dict[str, object]) -> str | None:
    """The first model fact of ``path``'s ``model_facts.json`` that this config changes (None: none, or no file)."""
    import json

    file = os.path.join(path, MODEL_FACTS_FILE)
    if not os.path.isfile(file):
        return None  # saved before model facts were kept: the tensor shapes are still checked
    try:
        with open(file) as f:
            saved = json.load(f)["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"cannot read {file} ({type(e).__name__}: {e})".replace("\n", " ")
    for key, value in facts.items():
        if key in saved and saved[key] != value:
            where = _FACT_CONFIG_KEY.get(key, "[model] flavor / hf_assets_path")
            return f"it was saved by a model with {key} = {saved[key]!r}, this config builds {key} = {value!r} ({where})"
    return None


def dataset_facts(ds) -> dict[str, object]:
    """What identifies a prompt file's usable rows: its path, their count and a hash of their token ids."""
    return {"path": ds.path, "rows": len(ds), "fingerprint": ds.fingerprint()}


def dataset_problem(path: str, ds) -> str | None:
    """Why the checkpoint at ``path`` was not taken on ``ds`` (its data position would index other rows), or None
    (the same rows, or no record: saved before datasets were recorded, or by a job without a prompt file)."""
    import json

    try:
        with open(os.path.join(path, MODEL_FACTS_FILE)) as f:
            saved = json.load(f).get("dataset")
    except (OSError, ValueError, AttributeError):
        return None  # facts_problem names an unreadable file
    now = dataset_facts(ds)
    if not isinstance(saved, dict) or saved.get("fingerprint") == now["fingerprint"]:
        return None
    return (f"[data] path: {path} was taken on {saved.get('path')} ({saved.get('rows')} usable rows, fingerprint "
            f"{saved.get('fingerprint')}); {now['path']} has {now['rows']} rows, fingerprint {now['fingerprint']}: "
            "other rows would be read from its saved position; resume on that file, or use a new [job] dump_folder")


def checkpoint_problem(path: str, expected: dict[str, tuple[int, ...]],
                       facts: dict[str, object] | None = None) -> str | None:
    """The first reason the DCP checkpoint at ``path`` cannot load into ``expected`` (a model with ``facts``),
    None if it can.

    Reads only ``model_facts.json``, ``.metadata`` (every saved tensor's shape and the byte range of the shard file that
    holds it) and ``stat``s the shard files: a checkpoint of another model size, a deleted or truncated
    shard are refused here instead of crashing every worker inside DCP."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    if facts is not None and (problem := facts_problem(path, facts)):
        return problem
    try:
        md = FileSystemReader(path).read_metadata()
    except Exception as e:  # a corrupt or foreign .metadata
        return f"cannot read {path}/.metadata ({type(e).__name__}: {e})".replace("\n", " ")
    saved = {k: tuple(v.size) for k, v in md.state_dict_metadata.items() if isinstance(v, TensorStorageMetadata)}
    for key, shape in expected.items():
        if key not in saved:
            if key.startswith("job_state."):
                continue  # saved by some balancers only
            return f"it lacks {key} (saved by a model with fewer layers or another layout?)"
        if saved[key] != shape:
            return f"{key} was saved with shape {list(saved[key])}, this config builds {list(shape)}"
    extra = [k for k in md.state_dict_metadata if not k.startswith(_NOT_MODEL) and k not in expected]
    if extra:
        return f"it holds {extra[0]}, which this config's model has not (saved by a larger model?)"
    need: dict[str, int] = {}
    for info in md.storage_data.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name in sorted(need):
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            return f"shard file {file} is missing"
        if (size := os.path.getsize(file)) < need[name]:
            return f"shard file {file} is truncated ({size} bytes, .metadata needs {need[name]})"
    return None


def effective_load_step(cfg: JobConfig) -> int:
    """``[checkpoint] load_step``, except in a torchrun restart (``MAX_RESTARTS``): the first attempt set the newer
    steps aside, so what is newer now is this branch's, and the restart resumes from the latest (-1)."""
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") not in ("", "0"):
        return -1
    return cfg.checkpoint.load_step


def complete_steps(folder: str) -> list[int]:
    """Every complete ``step-N`` of ``folder``, newest first."""
    if not os.path.isdir(folder):
        return []
    return sorted((int(m.group(1)) for name in os.listdir(folder)
                   if (m := re.fullmatch(r"step-(\d+)", name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))),
                  reverse=True)


def older_step_hint(folder: str, step: int, full: bool = False) -> str:
    """Which older complete step verifies against its checksums, as the flag to resume from it."""
    from .checksums import first_mismatch

    for s in complete_steps(folder):
        if s < step and first_mismatch(os.path.join(folder, f"step-{s}"), full=full) is None:
            return f"the newest older step that verifies is step-{s}: resume from it with --checkpoint.load_step={s}"
    return "no older complete step verifies; use a new [job] dump_folder to start over"


def _require_step(folder: str, load_step: int, latest: int) -> None:
    if not os.path.isfile(os.path.join(folder, f"step-{load_step}", ".metadata")):
        raise ConfigError(f"[checkpoint] load_step: {folder}/step-{load_step} is not a complete checkpoint")
    if load_step > latest:
        raise ConfigError(f"[checkpoint] load_step: {load_step} is newer than the latest complete step {latest}")


def check_writable(key: str, path: str) -> None:
    """Create ``path`` if needed and write a probe file in it (``os.access`` is always true for root)."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write_probe_", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise ConfigError(f"{key}: {path} is not a writable folder ({e.strerror or e})") from None


def check_output_folders(cfg: JobConfig) -> None:
    check_writable("[job] dump_folder", cfg.job.dump_folder)
    if cfg.checkpoint.enable:
        check_writable("[checkpoint] folder", checkpoint_folder(cfg))
    if cfg.metrics.enable_tensorboard:
        check_writable("[metrics] save_tb_folder", os.path.join(cfg.job.dump_folder, cfg.metrics.save_tb_folder))
    if cfg.rl.enable and cfg.rl.save_loads:
        check_writable("[rl] save_loads", os.path.join(cfg.job.dump_folder, "loads"))
    if cfg.rl.enable and cfg.rl.rollout_source in ("vllm", "sglang"):  # a live engine
        section = "rollout_engine" if cfg.rl.rollout_source == "vllm" else "sglang_engine"
        e = getattr(cfg, section)
        check_writable(f"[{section}] weights_dir", e.weights_dir or os.path.join(cfg.job.dump_folder, "engine_weights"))
        if not (e.url or e.urls) and cfg.rl.rollout_source == "vllm":
            check_engine_python(os.path.expanduser(e.python))
            check_engine_limits(os.path.expanduser(e.python), cfg.model.hf_assets_path)
        elif not (e.url or e.urls):
            check_sglang_python(os.path.expanduser(e.python))
        if (e.url or e.urls) and cfg.rl.rollout_source == "vllm":
            check_user_engine(e)


def check_user_engine(e) -> None:
    """The engines the user runs (``[rollout_engine] url`` / ``urls``), on the node the trainer runs on (issue 46): a weight sync
    that needs the trainer's GPUs on a job without them is refused, and the engine is asked once (reachable, a vLLM
    we speak, our worker extension when the sync loads through it), before any worker starts."""
    from ..rollouts.engines.engine_probe import probe
    from ..rollouts.engines.errors import EngineError
    from .validate import _job_device_type

    if e.weight_sync == "nccl" and _job_device_type() != "cuda":
        raise ConfigError(f"[rollout_engine] weight_sync: 'nccl' needs GPUs on the trainer's side (the engine's NCCL "
                          f"weight transfer is CUDA-only); this job's device is {_job_device_type()}: use 'reload' "
                          "or 'restart'")
    key = "urls" if e.urls else "url"
    for url in list(e.urls) or [e.url]:  # every engine of the fleet, once
        try:
            probe(url, min(e.request_timeout_s, 10.0),
                  extension=e.weight_sync in ("nccl", "ipc") and e.fused_expert_load)
        except EngineError as err:
            raise ConfigError(f"[rollout_engine] {key}: {err}") from None


def check_engine_limits(python: str, folder: str) -> None:
    """A vLLM version we do not speak, or a model the launched engine cannot run (the CPU engine's kernel sizes),
    is refused here, before the workers export its weights and the engine spends its start-up on it."""
    from ..rollouts.engines.errors import EngineError
    from ..rollouts.engines.vllm_api import api_for, engine_package
    from ..rollouts.engines.vllm_limits import cpu_limit_error

    pkg = engine_package(python)
    if pkg is not None and pkg.name:
        try:
            api_for(pkg.version, f"{pkg.name} in {python}")
        except EngineError as e:
            raise ConfigError(f"[rollout_engine] python: {e}") from None
    if pkg is not None and pkg.on_cpu and (why := cpu_limit_error(folder)):
        raise ConfigError(f"[model] hf_assets_path: {why}")


def check_engine_python(python: str) -> None:
    """The engine interpreter finds vLLM (and, on CPU, our route-capture plugin) without importing them (~0.1 s)."""
    import subprocess

    code = ("import importlib.util as u, sys;"
            " m = [n for n in ('vllm', 'titan_foremoe_vllm_cpu') if u.find_spec(n) is None];"
            " print(' '.join(m)); sys.exit(1 if m else 0)")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ConfigError(f"[rollout_engine] python: {python} does not run ({err})") from None
    if r.returncode != 0:
        raise ConfigError(f"[rollout_engine] python: {python} lacks {r.stdout.strip() or r.stderr.strip()[-200:]}: "
                          "build the engine venv with scripts/setup_vllm_cpu.sh")


def check_sglang_python(python: str) -> None:
    """The engine interpreter finds SGLang without importing it (~0.1 s)."""
    from ..rollouts.engines.sglang_server import sglang_missing

    if why := sglang_missing(python):
        raise ConfigError(f"[sglang_engine] python: {why}: install SGLang there (docs/rollouts_sglang.md)")


def check_resume(cfg: JobConfig) -> int:
    """The step the job resumes from (-1: fresh start); ``ConfigError`` / ``JobFinished`` otherwise."""
    if not cfg.checkpoint.enable:
        return -1
    folder = checkpoint_folder(cfg)
    step = latest_complete_step(folder)
    last = job_steps(cfg)
    hf = latest_hf_export_step(folder)
    if hf is not None and hf > step and effective_load_step(cfg) < 0:
        if hf >= last:
            raise JobFinished(
                f"job already finished: final HF checkpoint {folder}/step-{hf} is step {hf} of {last}; nothing to do "
                "(use a new [job] dump_folder to train again)"
            )
        raise ConfigError(
            f"[checkpoint] folder: the newest checkpoint {folder}/step-{hf} is a model-only HF export; "
            f"training cannot resume from it to step {last} (move it away or use a new dump_folder)"
        )
    if step < 0:
        return -1
    load = effective_load_step(cfg)
    if load >= 0:  # honoured before "finished": a branch from an older step of a finished job
        _require_step(folder, load, step)
        step = load
    path = os.path.join(folder, f"step-{step}")
    if step >= last:
        raise JobFinished(
            f"job already finished: {path} is step {step} of {last}; nothing to do "
            f"(outputs left as they are; raise --training.steps to continue)"
        )
    verify_checksums(cfg, folder, step)
    args = checked_model_args(cfg)
    expected, facts = expected_shapes(cfg, args), model_facts(args)
    problem = checkpoint_problem(path, expected, facts)  # DCP metadata: read only when the job goes on
    if problem:
        older = [s for s in range(step - 1, -1, -1) if os.path.isfile(os.path.join(folder, f"step-{s}", ".metadata"))
                 and checkpoint_problem(os.path.join(folder, f"step-{s}"), expected, facts) is None]
        hint = (f"the older complete checkpoint step-{older[0]} passes these checks: resume from it with "
                f"--checkpoint.load_step={older[0]}" if older else "no older complete checkpoint passes these checks; "
                "use a new [job] dump_folder to start over")
        raise ConfigError(f"[checkpoint] folder: {path} cannot serve this job: {problem}; {hint}")
    keys = checkpoint_keys(path)
    if "train_state.step" not in keys:
        earlier = [
            s for s in range(step) if os.path.isfile(os.path.join(folder, f"step-{s}", ".metadata"))
            and "train_state.step" in checkpoint_keys(os.path.join(folder, f"step-{s}"))
        ]
        hint = (f"remove it to resume from the full checkpoint step-{earlier[-1]}" if earlier
                else "use a new [job] dump_folder to start over")
        raise ConfigError(
            f"[training] steps: cannot extend the job to {last} steps: the latest checkpoint {path} holds model "
            f"weights only ([checkpoint] last_save_model_only = true), no optimizer or step state; {hint}"
        )
    if cfg.rl.enable and cfg.rl.kl_coef > 0 and "job_state.kl_reference.taken" not in keys:
        raise ConfigError(
            f"[rl] kl_coef: {cfg.rl.kl_coef} needs the KL reference policy, but {path} was saved without one "
            "(kl_coef = 0); resume with --rl.kl_coef=0 or use a new [job] dump_folder"
        )
    if cfg.balance.balancer != "off" and cfg.balance.owner_policy == "balanced" \
            and "job_state.expert_layout.owner_LE" not in keys:
        raise ConfigError(
            f"[balance] owner_policy: 'balanced' resumes the owner map saved by a balanced run, but {path} was saved "
            "without one (contiguous owners); resume with --balance.owner_policy=contiguous or use a new [job] "
            "dump_folder"
        )
    return step


def verify_checksums(cfg: JobConfig, folder: str, step: int) -> None:
    """The step to load matches the checksums its save recorded (``[checkpoint] verify``), else one line naming
    the file and the newest older step that verifies."""
    from .checksums import first_mismatch

    mode = cfg.checkpoint.verify
    if mode == "off":
        return
    path = os.path.join(folder, f"step-{step}")
    why = first_mismatch(path, full=mode == "full")
    if why:
        raise ConfigError(f"[checkpoint] folder: {path} cannot serve this job: {why}; "
                          f"{older_step_hint(folder, step, full=mode == 'full')}")


def check_folder_free(cfg: JobConfig) -> None:
    """No other live job holds ``[job] dump_folder`` (``distributed/folder_lock.py``); ours is skipped, and so is
    every node but ``NODE_RANK`` 0 (on a shared folder they would find node 0's lock)."""
    from ..distributed.folder_lock import LOCK_ENV, FolderBusy, check_free

    if os.environ.get("NODE_RANK", "0") != "0":
        return
    try:
        check_free(cfg.job.dump_folder, own=os.environ.get(LOCK_ENV))
    except FolderBusy as e:
        raise ConfigError(str(e)) from None  # it names the key


def preflight(cfg: JobConfig) -> int:
    """All file-system checks; returns the resume step (-1: fresh start)."""
    try:
        check_output_folders(cfg)
    except ConfigError:  # a finished job's folder only needs reading (made read-only to keep it): say it finished
        try:
            check_resume(cfg)
        except ConfigError:
            pass
        raise
    check_folder_free(cfg)
    return check_resume(cfg)
