"""The names of the precision policies and their aliases: one table for the scope and the launcher.

A leaf module (no torch): ``mixed_precision()``, ``accel-ctx launch --mixed-precision`` and the
config file all read it, so a spelling accepted by one is accepted by all.

Examples:
    >>> from accel_ctx._precision.names import canonical
    >>> canonical("bfloat16"), canonical("off"), canonical("FP8"), canonical("int8")
    ('bf16', 'no', 'fp8', None)
    >>> canonical("16-true"), canonical("BF16-true")  # true half: the model itself in half
    ('fp16-true', 'bf16-true')
"""

from __future__ import annotations

POLICIES = ("bf16", "fp16", "fp8", "no", "bf16-true", "fp16-true")
"""The policies, by their canonical names."""

ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "fp32": "no",
    "float32": "no",
    "float8": "fp8",
    "none": "no",
    "off": "no",
    "16-true": "fp16-true",  # Lightning Fabric's name ("bf16-true" is the same in both)
    "bf16_true": "bf16-true",
    "fp16_true": "fp16-true",
}
"""Other spellings users write, and the policy each means."""


def canonical(name: str) -> str | None:
    """The canonical policy for ``name`` (any case, alias or not); None when it is no policy."""
    lowered = name.strip().lower()
    lowered = ALIASES.get(lowered, lowered)
    return lowered if lowered in POLICIES else None
