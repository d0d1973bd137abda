"""Peak host memory of token log-probs + entropy (forward and backward): full fp32 ``log_softmax`` vs chunks.

Each variant runs in a fresh process; the figure is the growth of peak RSS over the process's RSS once the
bf16 logits exist (the logits' own gradient, in bf16, is part of both figures).

    python scripts/bench_logprobs_memory.py --tokens 2048 --vocab 151936 --chunk 256
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys


def _child(mode: str, tokens: int, vocab: int, chunk: int) -> None:
    import torch

    from titan_foremoe.rl.logprobs import token_logprobs_entropy

    torch.manual_seed(0)
    logits = torch.empty(1, tokens, vocab, dtype=torch.bfloat16).normal_().requires_grad_()  # no fp32 temporary
    targets = torch.randint(0, vocab, (1, tokens))
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    if mode == "full":  # the trainer's former path, plus the entropy from the same log_softmax
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
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--child", choices=["full", "chunked"])
    a = ap.parse_args()
    if a.child:
        return _child(a.child, a.tokens, a.vocab, a.chunk)
    gib = a.tokens * a.vocab / 2**30
    print(json.dumps({"tokens": a.tokens, "vocab": a.vocab, "chunk": a.chunk, "logits_bf16_gib": 2 * gib,
                      "fp32_copy_gib": 4 * gib, "chunk_fp32_gib": 4 * a.chunk * a.vocab / 2**30}))
    for mode in ("full", "chunked"):
        out = subprocess.run([sys.executable, __file__, "--child", mode, "--tokens", str(a.tokens), "--vocab",
                              str(a.vocab), "--chunk", str(a.chunk)], check=True, capture_output=True, text=True)
        print(out.stdout.strip())


if __name__ == "__main__":
    main()
