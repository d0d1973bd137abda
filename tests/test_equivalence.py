"""FSDP2 + EP=4 on 4 gloo ranks gives the loss and gradients of one process.

The distributed run uses the real trainer (meshes, EP shards, FSDP2, explicit
micro-steps, global token normalisation); the reference is the same model,
unparallelised, fed the concatenation of every rank's micro-batches.
"""

from __future__ import annotations

import torch

from distributed_helpers import run_ranks, sft_step
from titan_foremoe.config import load_config

OVERRIDES = [
    "--model.expert_dtype=float32",
    "--training.local_batch_size=2",
    "--training.global_batch_size=16",  # 2 micro-steps of 2 sequences on each of 4 ranks
    "--training.seq_len=24",
    "--parallelism.expert_parallel_degree=4",
    "--metrics.enable_tensorboard=false",
]


def _config(tmp):
    return load_config("train_configs/debug_tiny_cpu.toml", OVERRIDES + [f"--job.dump_folder={tmp}"])


def _reference(cfg, world_size: int, params: dict[str, torch.Tensor]):
    """Single-process loss and gradients over the whole global batch, from the ranks' initial weights."""
    from titan_foremoe.config.validate import model_args, validate
    from titan_foremoe.data.sft import sft_micro_batch
    from titan_foremoe.data.tasks import build_task
    from titan_foremoe.data.tokenizer import CharTokenizer
    from titan_foremoe.distributed.parallelize import build_model
    from titan_foremoe.train.trainer import token_loss_sum

    resolved = validate(cfg, world_size)
    tok, task = CharTokenizer(), build_task(cfg.data)
    model = build_model(cfg, model_args(cfg, vocab_size=tok.vocab_size), None, torch.device("cpu"))
    missing, unexpected = model.load_state_dict(params, strict=False)
    assert not unexpected and not any(k in dict(model.named_parameters()) for k in missing)
    batches = [
        sft_micro_batch(task, tok, seed=cfg.job.seed, step=0, micro_step=m, dp_rank=r,
                        batch_size=cfg.training.local_batch_size, seq_len=cfg.training.seq_len)
        for m in range(resolved.micro_steps)
        for r in range(resolved.dp_degree)
    ]
    denominator = float(sum(b.num_label_tokens for b in batches))
    loss = sum(token_loss_sum(model(b.inputs_BL), b.labels_BL) for b in batches) / denominator
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return float(loss.detach()), grads


def _distributed(rank, world_size, tmp, out_path):
    from titan_foremoe.train.trainer import Trainer

    trainer = Trainer(_config(tmp))
    out = sft_step(trainer)
    if rank == 0:
        torch.save(out, out_path)
    torch.distributed.destroy_process_group()


def test_fsdp_ep4_step_matches_single_process(tmp_path):
    out_path = tmp_path / "out.pt"
    run_ranks(_distributed, 4, str(tmp_path), str(out_path))
    out = torch.load(out_path)

    ref_loss, ref_grads = _reference(_config(tmp_path), 4, out["params"])
    assert abs(out["loss"] - ref_loss) <= 1e-5 * abs(ref_loss)
    assert set(out["grads"]) == set(ref_grads)
    for name, ref_g in ref_grads.items():
        assert ref_g.abs().sum() > 0, name  # every parameter took part
        torch.testing.assert_close(out["grads"][name], ref_g, rtol=1e-5, atol=1e-7, msg=name)
    experts = [n for n in ref_grads if "w1_EFD" in n]
    assert experts and all(ref_grads[n].shape[0] == 8 for n in experts)
