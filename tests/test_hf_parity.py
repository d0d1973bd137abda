"""Our model, loaded from an HF Qwen3-MoE folder on 4 gloo ranks (FSDP2 + EP=4, fp32), against transformers.

The folder is made here (random ``Qwen3MoeForCausalLM`` + a word-level tokenizer
with a chat template); the reference is transformers' own implementation:

1. logits on random token batches equal within 1e-5;
2. the experts our router records for every token equal transformers' router
   top-k (``output_router_logits``);
3. greedy rollout (batched, left-padded, KV cache) gives ``generate``'s token ids;
4. load -> save (torchtitan's checkpointer, HF layout) gives every tensor back
   bit for bit, and the saved folder loads in transformers.

It also checks that a checkpoint restores the dataset position.

It also checks that a rollout all-gathers FSDP parameters once, not per token.
One spawned group runs all of it.
"""

from __future__ import annotations

import os

import pytest
import torch

from distributed_helpers import run_ranks

torch.manual_seed(0)
TOKENS_BL = torch.randint(3, 60, (3, 11))
QUESTIONS = ["Ben has 5 stamps. Ben gets 9 more stamps. How many stamps does Ben have now?",
             "Lea has 4 books. Lea gives away 1 books. How many books are left?",
             "Tom has 2 bags with 3 pens in each bag. How many pens does Tom have?"]
SYSTEM = "Solve the problem. Put the final answer in \\boxed{}."
NEW_TOKENS = 8


def _overrides(hf, tmp):
    return [
        f"--model.hf_assets_path={hf}", f"--job.dump_folder={tmp}", "--metrics.enable_tensorboard=false",
        "--data.path=examples/arithmetic_word_problems.jsonl", "--rl.sft_warmup_steps=0", "--training.steps=1",
        "--rl.temperature=0", "--checkpoint.interval=1", "--balance.balancer=off", "--rl.dump_rollouts=false",
    ]


def _ranks(rank, world_size, hf, tmp, out_path):
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_group

    from titan_foremoe.config import load_config
    from titan_foremoe.models.seams import recorded_routes, routing
    from titan_foremoe.rollouts.generate import GenerationConfig, generate
    from titan_foremoe.train.rl_trainer import RLTrainer

    cfg = load_config("train_configs/qwen3_moe_hf_grpo.toml", _overrides(hf, tmp))
    trainer = RLTrainer(cfg)
    assert trainer.checkpointer.load(step=-1)  # initial_load_in_hf from [model] hf_assets_path
    # what DCP's HF reader was asked for: DTensor shards, so each rank read (get_slice) only its own part
    from torch.distributed.tensor import DTensor

    sd = trainer.checkpointer.states["model"].state_dict()
    local = sum(v.to_local().numel() if isinstance(v, DTensor) else v.numel() for v in sd.values())
    all_dtensor = all(isinstance(v, DTensor) for v in sd.values())
    local_fraction = local / sum(v.numel() for v in sd.values())
    model = trainer.model
    model.eval()
    with torch.no_grad(), routing(model, record=True):
        logits = model(TOKENS_BL)
        routes = recorded_routes(model)

    gathers = []
    real = fsdp_group.foreach_all_gather

    def counting(*a, **k):
        gathers.append(1)
        return real(*a, **k)

    fsdp_group.foreach_all_gather = counting
    with torch.no_grad():
        model(TOKENS_BL)
    per_forward = len(gathers)
    gathers.clear()
    tok = trainer.tokenizer
    prompts = [tok.chat_prompt(q, SYSTEM) for q in QUESTIONS]
    rollout = generate(model, prompts, GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.0),
                       eos_id=tok.eos_ids, pad_id=tok.pad_id, num_experts=trainer.model_args.num_experts,
                       generator=torch.Generator().manual_seed(0))
    per_rollout = len(gathers)
    fsdp_group.foreach_all_gather = real

    # an interval checkpoint: DCP (model, optimizer, dataset position) + an HF copy of the weights in step-1/hf
    trainer.dataset.take(8, trainer.dp_rank, 4)
    consumed = trainer.dataset.consumed
    trainer.checkpointer.save(1)
    trainer._hf_side_files(1, last=2)
    trainer.dataset.take(8, trainer.dp_rank, 4)
    assert trainer.checkpointer.load(step=1)
    assert trainer.dataset.consumed == consumed == 8
    if rank == 0:
        torch.save({
            "logits": logits, "routes": routes, "prompts": prompts,
            "completions": [rollout.completion(b) for b in range(len(prompts))],
            "per_forward": per_forward, "per_rollout": per_rollout,
            "all_dtensor": all_dtensor, "local_fraction": local_fraction,
        }, out_path)
    trainer.close()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    from titan_foremoe.data.tiny_hf import make_tiny_checkpoint, read_texts

    tmp = tmp_path_factory.mktemp("hf")
    hf = make_tiny_checkpoint(str(tmp / "tiny"), read_texts("examples/arithmetic_word_problems.jsonl"),
                              n_layers=2, num_experts=8, top_k=2)
    out_path = tmp / "out.pt"
    run_ranks(_ranks, 4, hf, str(tmp), str(out_path))
    return hf, str(tmp / "checkpoint" / "step-1" / "hf"), torch.load(out_path)


def _hf_model(path):
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_each_rank_holds_and_reads_a_quarter(parity):
    _, _, out = parity
    assert out["all_dtensor"] and out["local_fraction"] <= 0.26, out["local_fraction"]


def test_logits_equal_transformers(parity):
    hf, _, out = parity
    with torch.no_grad():
        ref = _hf_model(hf)(TOKENS_BL).logits
    assert out["logits"].shape == ref.shape
    torch.testing.assert_close(out["logits"], ref, rtol=0, atol=1e-5)


def test_routing_log_equals_transformers_top_k(parity):
    hf, _, out = parity
    with torch.no_grad():
        res = _hf_model(hf)(TOKENS_BL, output_router_logits=True)
    B, L = TOKENS_BL.shape
    for layer, router_logits in enumerate(res.router_logits):
        top_BLK = router_logits.softmax(-1).topk(2, dim=-1).indices.view(B, L, 2)
        assert torch.equal(out["routes"][:, :, layer].sort(-1).values, top_BLK.sort(-1).values), layer


def test_greedy_rollout_equals_generate(parity):
    hf, _, out = parity
    model = _hf_model(hf)
    for prompt, ours in zip(out["prompts"], out["completions"]):
        ids = torch.tensor([prompt])
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert ours == ref[0, len(prompt):].tolist()


def test_load_save_round_trip_is_exact_and_loads_in_transformers(parity):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    hf, saved, _ = parity

    def tensors(folder):
        out = {}
        for name in os.listdir(folder):
            if name.endswith(".safetensors"):
                out.update(load_file(os.path.join(folder, name)))
        return out

    a, b = tensors(hf), tensors(saved)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    _hf_model(saved)
    assert AutoTokenizer.from_pretrained(saved).chat_template


def test_rollout_unshards_once_not_per_token(parity):
    _, _, out = parity
    assert out["per_forward"] > 0
    assert out["per_rollout"] == out["per_forward"]  # one all-gather per FSDP group for ~9 forwards
