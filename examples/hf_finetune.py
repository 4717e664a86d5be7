"""Fine-tuning a Hugging Face transformers model, built from a config (nothing downloaded).

Needs ``pip install transformers``. The model is a tiny GPT-2 made from ``GPT2Config``; the loop
is the plain one transformers' own examples write, with the scopes around it.

    python examples/hf_finetune.py
    accel-ctx launch -n 2 examples/hf_finetune.py
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch
from torch.utils.data import DataLoader, TensorDataset

from accel_ctx import distributed, main_print, mixed_precision

# Where torchao is installed (`pip install -e ".[dev]"` or ".[fp8]" installs it), transformers
# imports it, and torchao logs a line per CUDA kernel library it cannot load ("Failed to load
# .../torchao/_C_mxfp8...so") on a machine without CUDA: harmless (they are GPU kernels), and
# torch adds a deprecation notice per Enum torchao registers. Kept out of this example's output;
# in your own script, the same filter around `import transformers` does it.
_IMPORT_NOISE = [("torch.utils._pytree", "is an Enum subclass and is now natively supported")]
if not torch.cuda.is_available():
    _IMPORT_NOISE.append(("torchao", "Failed to load"))


def _not_import_noise(record: logging.LogRecord) -> bool:
    return not any(record.name == name and text in record.getMessage()
                   for name, text in _IMPORT_NOISE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--precision", default="bf16", choices=["no", "bf16", "fp16"])
    args = parser.parse_args()
    loggers = [logging.getLogger(name) for name, _ in _IMPORT_NOISE]
    for logger in loggers:
        logger.addFilter(_not_import_noise)
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        print("this example needs transformers: pip install transformers", file=sys.stderr)
        raise SystemExit(2) from None
    finally:
        for logger in loggers:
            logger.removeFilter(_not_import_noise)

    torch.manual_seed(0)
    # a vocabulary of 128 tokens: its begin/end token is 0, not GPT-2's 50256 (which
    # transformers would report as out of the vocabulary)
    config = GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    ids = (torch.arange(32) + torch.randint(0, 128, (256, 1))) % 128
    with distributed(), mixed_precision(args.precision):
        model = GPT2LMHeadModel(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = DataLoader(TensorDataset(ids), batch_size=16, shuffle=True)
        step = 0
        while step < args.steps:
            for (batch,) in loader:
                out = model(input_ids=batch, labels=batch)
                out.loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                step += 1
                if step % 5 == 0:
                    main_print(f"step {step}: loss {out.loss.item():.3f}")
                if step >= args.steps:
                    break
        # the user's model, not a wrapper: its own methods (save_pretrained...) are there
        main_print(f"done: {step} steps, {type(model).__name__}, "
                   f"save_pretrained: {callable(model.save_pretrained)}")


if __name__ == "__main__":
    main()
