"""The public scopes, one module each: ``distributed``, ``sharded``, ``mixed_precision``,
``accumulate``, ``resumable``, and ``state()`` (``status``).

Docstring only, on purpose: each module holds a function or class of its own name, so a
re-export here would shadow the submodule; ``accel_ctx`` loads each on first use (``_HOMES``).
"""
