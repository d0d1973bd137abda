"""Peak host memory of token log-probs + entropy, forward and backward, from the final hidden states:
the model's full logits then an fp32 ``log_softmax`` (``full``), the full logits then the chunked log-probs
(``chunked``), and the fused head that builds each chunk's logits from the hidden states and the lm_head
weight in both passes (``fused``, what the RL trainer runs).

Each variant runs in a fresh process; the figure is the growth of peak RSS over the process's RSS once the
hidden states ``[tokens, dim]`` and lm_head weight ``[vocab, dim]`` exist (the gradients of both are part of
every figure). ``--dtype`` is the model's compute dtype (bf16 on GPUs; CPU bf16 GEMMs can be very slow, so
``float32`` measures the same buffers at twice the size for the model-dtype ones).

    python benchmarks/bench_logprobs_memory.py --tokens 4096 --vocab 151936 --dim 256 --chunk 1024 --dtype float32
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

import torch

MODES = ("full", "chunked", "fused")


def _child(mode: str, tokens: int, vocab: int, dim: int, chunk: int, dtype: str) -> None:
    import torch

    from titan_foremoe.rl.logprobs import lm_head_logprobs, token_logprobs_entropy

    torch.manual_seed(0)
    dt = getattr(torch, dtype)

    class Tail(torch.nn.Module):  # the decoder's tail: lm_head on the final hidden states
        def __init__(self):
            super().__init__()
            self.lm_head = torch.nn.Linear(dim, vocab, bias=False, dtype=dt)

        def forward(self, h):
            return self.lm_head(h)

    tail = Tail()
    h = (torch.empty(1, tokens, dim, dtype=dt).normal_() * 0.1).requires_grad_()
    targets = torch.randint(0, vocab, (1, tokens))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "fused":
        with lm_head_logprobs(tail, targets, chunk=chunk):
            logp, ent = tail(h)
    else:
        logits = tail(h)
        if mode == "full":  # the trainer's first path, plus the entropy from the same log_softmax
            ls = torch.log_softmax(logits.float(), dim=-1)
            logp = ls.gather(-1, targets[..., None]).squeeze(-1)
            ent = -(ls.exp() * ls).sum(-1)
        else:
            logp, ent = token_logprobs_entropy(logits, targets, chunk=chunk)
    (logp.sum() + 0 * ent.detach().sum()).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"mode": mode, "extra_peak_gib": (peak - base) / 2**20}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--child", choices=MODES)
    a = ap.parse_args()
    if a.child:
        return _child(a.child, a.tokens, a.vocab, a.dim, a.chunk, a.dtype)
    gib = a.tokens * a.vocab / 2**30
    print(json.dumps({"tokens": a.tokens, "vocab": a.vocab, "dim": a.dim, "chunk": a.chunk, "dtype": a.dtype,
                      "logits_gib": gib * getattr(torch, a.dtype).itemsize, "fp32_copy_gib": 4 * gib,
                      "chunk_fp32_gib": 4 * a.chunk * a.vocab / 2**30,
                      "weight_grad_gib": a.vocab * a.dim * getattr(torch, a.dtype).itemsize / 2**30}))
    for mode in MODES:
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--tokens", str(a.tokens), "--vocab",
                              str(a.vocab), "--dim", str(a.dim), "--chunk", str(a.chunk), "--dtype", a.dtype],
                             check=True, capture_output=True, text=True)
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
