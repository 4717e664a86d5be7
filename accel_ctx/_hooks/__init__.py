"""What a scope installs in torch while it is open: the patch registry (``patches``),
the functions put in place of torch's (``replacements``), what runs inside them (``gates``,
``step_gates``, ``user_scaler``), the scope base class (``scope``) and what Dynamo sees
(``tracing``).
"""
