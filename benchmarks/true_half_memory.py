"""What mixed_precision("bf16-true") saves in bytes, and what it costs in updates that round away.

Not a timing: one process, on the CPU, one AdamW step of the sharded benchmark's GPT (46M
parameters, tied embedding). First the tensor bytes held after the step in fp32 ("no"), under
"bf16" (autocast computes in bf16 but keeps fp32 weights, so its bytes are fp32's) and under
"bf16-true" (the model itself in bf16: parameters, gradients and AdamW state take half). Then,
per learning rate, the share of weights that first step changed at all: AdamW's first step
moves every weight by about the learning rate, and in bf16 (8 significant bits) a step smaller
than half the spacing of bf16 numbers around a weight rounds back to the weight itself.

    python benchmarks/true_half_memory.py            # ~1 min
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.nn.functional as F
from _models import GPTConfig, make_gpt, parameter_count

from accel_ctx import mixed_precision


def measure(policy: str, lr: float) -> dict[str, float]:
    cfg = GPTConfig()
    with mixed_precision(policy):
        model = make_gpt(cfg)
        opt = torch.optim.AdamW(model.parameters(), lr=lr)
        tokens = torch.randint(0, cfg.vocab, (2, cfg.seq + 1),
                               generator=torch.Generator().manual_seed(0))
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()).backward()
        before = {name: p.detach().clone() for name, p in model.named_parameters()}
        opt.step()
        params = dict(model.named_parameters())
        changed = {name: (p.detach() != before[name]) for name, p in params.items()}
        norms = [name for name in params if ".ln" in name and name.endswith("weight")]
        return {
            "parameters": sum(p.numel() * p.element_size() for p in params.values()),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for p in params.values()
                             if p.grad is not None),
            "AdamW state": sum(v.numel() * v.element_size() for s in opt.state.values()
                               for v in s.values() if isinstance(v, torch.Tensor)),
            "count": parameter_count(model),
            "changed": sum(int(c.sum()) for c in changed.values()) / parameter_count(model),
            "norms changed": (sum(int(changed[n].sum()) for n in norms)
                              / sum(params[n].numel() for n in norms)),
        }


def main() -> None:
    torch.set_num_threads(1)
    rows = {policy: measure(policy, 1e-4) for policy in ("no", "bf16", "bf16-true")}
    print(f"GPT {rows['no']['count'] / 1e6:.1f}M parameters, one AdamW step: bytes (MiB)")
    print(f"{'':14}" + "".join(f"{p:>22}" for p in rows))
    for key in ("parameters", "gradients", "AdamW state"):
        cells = "".join(f"{int(r[key]):>13,} ({r[key] / 2**20:5.1f})" for r in rows.values())
        print(f"{key:14}{cells}")
    print("\nshare of weights the first AdamW step changed (all / LayerNorm gains)")
    print(f"{'lr':>8}{'no':>22}{'bf16-true':>22}")
    for lr in (1e-3, 1e-4, 1e-5):
        cells = ""
        for policy in ("no", "bf16-true"):
            r = rows[policy] if lr == 1e-4 and policy in rows else measure(policy, lr)
            cells += f"{r['changed']:>13.1%} / {r['norms changed']:>6.1%}"
        print(f"{lr:>8g}{cells}")


if __name__ == "__main__":
    main()
