"""The software a job needs, checked in one line before anything imports torchtitan.

torchtitan 0.3.0 was released with torch 2.13 and ``spmd_types`` 0.2.3; ``torchtitan_patches/torch_compat.py``
fills the 2.13 names it and we use on torch 2.11 and 2.12 (the GPU machines lent here carry 2.11), so the trainer
runs on torch 2.11 through 2.14. On any other image it used to fail deep inside an import, without saying which
version it needs. Here the installed versions are read from the package metadata (nothing is imported), torchtitan
is then imported in a ``try`` (after the patches), and the torch features the trainer calls are looked up by name.
``problem()`` returns the first mismatch as one line; ``config.check`` (run before torchrun starts) ends the job
with it, and otherwise names what the compatibility module filled (``compat_line()``).

``features()`` is also the GPU check's environment report (``scripts/gpu_check.sh``), which runs where
torchtitan does not import: it imports nothing from torchtitan itself.

Cost: a few metadata reads and attribute look-ups, about 1 ms once per job (plus torchtitan's own import, which
the job pays anyway).
"""

from __future__ import annotations

import importlib
import importlib.metadata

# what the trainer runs on, as version prefixes (CI runs torch 2.13, pinned by pyproject.toml, and 2.11)
NEEDS = {"torch": ("2.11", "2.12", "2.13", "2.14"), "torchtitan": ("0.3.0",), "spmd_types": ("0.2.3",)}

# torch features the trainer (or its checks) calls, by dotted name -> what uses it
FEATURES = {
    "torch._grouped_mm": "the experts' grouped GEMM (bf16 on CUDA)",
    "torch.distributed.fsdp.fully_shard": "FSDP2",
    "torch.distributed.fsdp.MixedPrecisionPolicy": "bf16 parameters under FSDP2",
    "torch.distributed.tensor.DTensor": "sharded experts (EP) and FSDP2",
    "torch.distributed.all_to_all_single": "dispatch, replica transfers, gradient returns",
    "torch.distributed._functional_collectives.all_to_all_single": "compiled dispatch",
    "torch.distributed.checkpoint.save": "checkpoints (DCP)",
    "torch.Tensor.record_stream": "the transfer engine's side stream",
    "torch.cuda.set_sync_debug_mode": "the self-test's and the GPU check's no-sync regions",
    "torch.cuda._sanitizer.StreamSynchronizations": "the checked backend (stream order on CPU)",
    "torch.utils._python_dispatch.TorchDispatchMode": "the checked backend and the host-sync census",
    "torch._dynamo.config.capture_scalar_outputs": "torch.compile of the blocks",
}


def version(package: str) -> str | None:
    """Installed version of ``package`` from its metadata (not imported); None when absent."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def has(dotted: str) -> bool:
    """``dotted`` (``torch.distributed.fsdp.fully_shard``) resolves: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return False
        return True
    return False


def features() -> dict[str, bool]:
    return {name: has(name) for name in FEATURES}


def versions() -> dict[str, str | None]:
    return {p: version(p) for p in NEEDS}


def _needs_line() -> str:
    return ", ".join(f"{p} {v[0]}" + (f"-{v[-1]}" if len(v) > 1 else "") for p, v in NEEDS.items())


def supported(have: str, wants: tuple[str, ...]) -> bool:
    """``have`` (``2.11.0+cu130``) starts with one of the prefixes ``wants`` at a version boundary."""
    return any(have == w or have.startswith(w + ".") or have.startswith(w + "+") for w in wants)


def compat_line() -> str | None:
    """What ``torchtitan_patches.torch_compat`` filled in this process, as one line; None when nothing."""
    from torchtitan_patches import torch_compat

    if not torch_compat.PATCHED:
        return None
    return (f"environment: torch {version('torch')} runs with {len(torch_compat.PATCHED)} compatibility patches "
            f"(torchtitan_patches/torch_compat.py): " + "; ".join(torch_compat.PATCHED))


def problem(import_torchtitan: bool = True) -> str | None:
    """The first reason this environment cannot run the trainer, as one line; None when it can."""
    got = versions()
    for package, want in NEEDS.items():
        have = got[package]
        if have is None or not supported(have, want):
            found = "not installed" if have is None else f"{have} installed"
            return f"environment: {package} {found}; this trainer needs {_needs_line()} (pyproject.toml)"
    missing = [name for name, ok in features().items() if not ok]
    if missing:
        return (f"environment: torch {got['torch']} lacks {missing[0]} ({FEATURES[missing[0]]})"
                + (f" and {len(missing) - 1} more" if len(missing) > 1 else "") + f"; needs {_needs_line()}")
    if import_torchtitan:
        try:  # after the CPU patches, as every entry point imports it (torchtitan reads the device at import)
            importlib.import_module("torchtitan_patches").apply_all()
            importlib.import_module("torchtitan.models.common.moe")
        except Exception as e:  # the import error itself, in one line
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            return (f"environment: torchtitan {got['torchtitan']} does not import on torch {got['torch']} "
                    f"({type(e).__name__}: {first}); needs {_needs_line()}")
    return None
