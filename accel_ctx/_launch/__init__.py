"""The launcher wing: ``launch(fn)`` and the ``accel-ctx`` commands, beside the core.

It imports no core module (only leaves: ``errors``, ``_env``, ``_precision_names``), so the
``accel-ctx`` commands and ``launch()`` never load the scopes. ``accel_ctx.launch`` loads
:mod:`.fn` on first use; ``accel_ctx.cli`` loads the rest.

* :mod:`.fn`: ``launch(fn, nprocs)``, processes for a notebook or a test.
* :mod:`.args`: ``accel-ctx launch`` arguments -> torchrun's arguments (pure).
* :mod:`.config`, :mod:`.config_cmd`: the TOML files and ``accel-ctx config``.
* :mod:`.envinfo`: ``accel-ctx env``.
* :mod:`.netif`: which address and interface reach the master.
"""
