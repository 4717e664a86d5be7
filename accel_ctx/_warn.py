"""Warnings that point at the user's line, however deep inside accel_ctx they are raised."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import warnings

# Frames skipped on the way out to the user's code: ours, and the standard wrappers between
# a user's `with` line or decorated call and our code (ExitStack callbacks, functools.wraps).
_SKIPPED = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
    os.path.abspath(contextlib.__file__),
    os.path.abspath(functools.__file__),
)
# torch's Optimizer.step wrapper: it runs our step gate as a global pre-hook
_TORCH_STEP = os.path.join("torch", "optim", "optimizer.py")


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """Issue ``message`` as a warning attributed to the first caller outside accel_ctx."""
    level = 2  # 1 is this function; 2 its caller
    frame = sys._getframe(1)
    while frame.f_back is not None and (frame.f_code.co_filename.startswith(_SKIPPED)
                                        or frame.f_code.co_filename.endswith(_TORCH_STEP)):
        frame = frame.f_back
        level += 1
    warnings.warn(message, category, stacklevel=level)
