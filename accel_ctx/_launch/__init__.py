"""The launcher wing: ``launch(fn)`` and the ``accel-ctx`` commands, beside the core.

It imports no core module, only leaves (``errors``, ``_job.env``, ``_precision.names``,
``_options``), so the ``accel-ctx`` commands and ``launch()`` never load the scopes.
``accel_ctx.launch`` loads :mod:`.fn` on first use; ``accel_ctx.cli`` loads the rest.

* :mod:`.settings`: the one table of launcher settings (a new setting is one entry there).
* :mod:`.args`: ``accel-ctx launch`` arguments -> torchrun's arguments (pure);
  :mod:`.script`: the script (or ``-m`` module, or command) is there, checked before start;
  :mod:`.help`: its ``--help``; :mod:`.netif`: the address and interface that reach the master.
* :mod:`.config`, :mod:`.config_cmd`: the TOML files and ``accel-ctx config``.
* :mod:`.envinfo`: ``accel-ctx env``.
* :mod:`.fn`: ``launch(fn, nprocs)``, processes for a notebook or a test;
  :mod:`.nproc`: ``auto`` and the limit on processes per machine, for both launchers.
"""
