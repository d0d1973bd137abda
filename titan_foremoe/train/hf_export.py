"""Hugging Face folders out of torchtitan's checkpointer: the weights, plus the config and tokenizer files.

torchtitan's ``last_save_in_hf`` writes the final checkpoint's safetensors with
DCP's ``HuggingFaceStorageWriter`` (every rank writes the shards it owns; no
rank gathers the model). A folder transformers can load also needs
``config.json``, ``generation_config.json`` and the tokenizer files: they are
copied from ``[model] hf_assets_path``. Interval checkpoints stay DCP (they
carry the optimizer and RL state for resuming) and get an HF copy of the
weights in ``step-N/hf``.
"""

from __future__ import annotations

import os
import shutil

import torch
import torch.distributed as dist
from torchtitan.components.checkpointer.dcp import AsyncMode

from ..distributed import collectives
from ..models.hf import HF_SIDE_FILES


def copy_side_files(src: str, dst: str) -> None:
    """Config, generation config and tokenizer files of ``src`` into ``dst`` (rank 0; all ranks wait).

    Also drops ``dst/sharded``: the per-rank files torchtitan consolidates into
    the HF shards (an intermediate as large as the model).
    """
    if not dist.is_initialized() or dist.get_rank() == 0:
        os.makedirs(dst, exist_ok=True)
        shutil.rmtree(os.path.join(dst, "sharded"), ignore_errors=True)
        for name in HF_SIDE_FILES:
            if os.path.isfile(os.path.join(src, name)):
                shutil.copy2(os.path.join(src, name), os.path.join(dst, name))
    collectives.barrier()


def export_hf(checkpointer, folder: str, hf_assets_path: str, dtype: torch.dtype) -> None:
    """The model's weights as an HF folder at ``folder`` (collective: every rank calls it)."""
    states = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in checkpointer.states["model"].state_dict().items()}
    checkpointer.dcp_save(states, checkpoint_id=folder, async_mode=AsyncMode.DISABLED, to_hf=True)
    copy_side_files(hf_assets_path, folder)
