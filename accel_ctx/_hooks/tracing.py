"""``torch.compile`` and the patched ``nn.Module.__call__``: what Dynamo sees while it traces.

The patched ``__call__`` reads the stack (``_kernel.state.read_stack``, one ContextVar read) to tell
a top-level call, where the gates run, from a call inside a forward, which is torch's own path.
Dynamo cannot trace ``ContextVar.get``: every submodule call of a compiled model would break
the graph (a GPT of 3 blocks: 7 graphs where the same model outside a scope makes 1). So, for
Dynamo only, that one read is replaced (``torch.compiler.substitute_in_graph``) by the decision
taken at trace time:

- inside a forward (the compiled model's own submodules, or a compiled model called by the
  gates of its top-level call, which ran outside the compiled region): the read is traced as
  "no scope", and Dynamo traces torch's own call path, as outside any scope;
- a top-level call with a scope open (a compiled function that calls the model): the graph
  breaks at that call, and the gates run eagerly, once, as for an uncompiled call.

Under ``sp=`` the attention patch (``_hooks.attention``) is traced: its reads of the scope
(``sequence_size``, ``sequence_group``) are constants at trace time, as the decision above.

Eager calls are untouched (the replacement exists only for Dynamo). The decision is taken when
the frame is traced and not guarded: a compiled function that calls a module both inside some
forward and at the top level of the loop keeps the path of its first trace; compile the model
(or its blocks), not such a function. Registered once per process, when Dynamo has been
imported by the user's code: ``import accel_ctx`` and the scopes never import Dynamo (about 1 s).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from .._kernel import state as _state
from . import attention as _attention

registered = False
"""Whether Dynamo knows how to trace ``read_stack`` in this process (read per top-level call)."""
_module_calls: list[Any] = []
on_dynamo_loaded: Callable[[], None] | None = None
"""Set by ``_hooks.patches``: installs its patches of Dynamo's classes once Dynamo is imported."""
_RUN_EAGERLY = ("_checkpoint", "_data", "_engines", "_group", "_hooks.gates", "_hooks.scope",
                "_hooks.step_gates", "_hooks.user_scaler", "_job", "_kernel", "_precision",
                "_ranks", "_scopes", "_steps")


def _gates_would_run() -> bool:
    """Evaluated by Dynamo at trace time (a constant in the graph): the patched ``__call__``'s
    own test for a top-level call."""
    stack = _state.read_stack()
    return stack is not None and not stack.in_forward


def installing(module_call: Any) -> None:
    """The patches install ``module_call`` as ``nn.Module.__call__``."""
    if module_call not in _module_calls:
        _module_calls.append(module_call)
        if registered:
            skip_as_a_frame(module_call)
    register_if_dynamo_loaded()


def skip_as_a_frame(function: Any) -> None:
    """Dynamo runs ``function`` eagerly and traces from the frames it calls (Dynamo is loaded)."""
    from torch._dynamo.eval_frame import skip_code

    # A model compiled inside a scope compiles its bound __call__ (ours) as the top frame:
    # skipped, as torch's own __call__ is, it runs eagerly (the gates have run: torch's path)
    # and Dynamo starts at the frames below it, hooks outside the graph as without a scope.
    skip_code(function.__code__)


def register_if_dynamo_loaded() -> None:
    """Teach Dynamo the stack read and the patched ``nn.Module.__call__``, once, if the user's
    code has imported Dynamo already."""
    global registered
    if registered or "torch._dynamo" not in sys.modules:
        return
    registered = True
    from torch._dynamo import graph_break, trace_rules
    from torch.compiler import substitute_in_graph

    for module_call in _module_calls:
        skip_as_a_frame(module_call)
    if on_dynamo_loaded is not None:
        on_dynamo_loaded()
    # Our own code runs eagerly, outside any graph, like the gates: a compiled function that
    # reaches it breaks there once instead of tracing part of it; the model's forward below
    # a gate is compiled as a frame of its own.
    for name in _RUN_EAGERLY:
        trace_rules.add(f"{__package__.rpartition('.')[0]}.{name}")

    # A function that stands for itself, constant-folded: Dynamo calls it while tracing.
    substitute_in_graph(_gates_would_run, can_constant_fold_through=True)(_gates_would_run)
    # sp=: the scope's facts for the attention patch, constants of the graph (_hooks.attention)
    for fact in (_attention.sequence_size, _attention.sequence_group):
        substitute_in_graph(fact, can_constant_fold_through=True)(fact)

    @substitute_in_graph(_state.read_stack, skip_signature_check=True)
    def _read_stack_while_tracing() -> Any:
        if _gates_would_run():
            graph_break("accel_ctx: a module called at the top level inside a compiled function; "
                        "its scope's gates run eagerly here (compile the model instead)")
        return None  # torch's own call path, as outside any scope
