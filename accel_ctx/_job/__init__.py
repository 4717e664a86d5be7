"""The job as data, below the process group: ``coordinates``, the launch environment
(``env``), ``options`` and the knobs they check (``comm_hook``, ``tp_plan``), ``job``, and
where each rank is (``progress``, ``heartbeat``). No process group is formed here; the
launcher reads ``env`` and ``coordinates``, so this ``__init__`` imports nothing.
"""
