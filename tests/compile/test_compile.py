"""torch.compile inside the scopes traces to the graphs it makes without accel_ctx.

The patched ``nn.Module.__call__`` reads a ContextVar, which Dynamo cannot trace: before
``_hooks.tracing`` each submodule call of a compiled model broke the graph (a GPT of 3 blocks made
10 graphs). Two real gloo ranks train a GPT-shaped model (tied embeddings, attention, MLP) under
``distributed()`` (DDP), ``mixed_precision``, ``accumulate(2)`` and ``sharded()`` (FSDP2), compiled
as a whole, before the scope or per block, and count Dynamo's graphs, graph breaks and recompiles
against the same model compiled without accel_ctx.
"""

from __future__ import annotations

import pytest
import torch

from .._spawn import spawn
from ..workers import compiled


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return spawn(compiled.run_all, 2, tmp_path_factory.mktemp("compiled"), timeout=300)


def _same_weights(a, b, rtol=1e-5, atol=1e-6):
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=rtol, atol=atol, msg=k)


WHOLE_MODEL = [("distributed", "whole"), ("distributed", "before"), ("bf16", "whole"),
               ("fp16", "whole"), ("accumulate", "whole")]


@pytest.mark.parametrize(("scopes", "how"), WHOLE_MODEL)
def test_a_compiled_model_makes_one_graph_and_no_break_inside_the_scopes(two_ranks, scopes, how):
    for rank in two_ranks:
        plain, run = rank["by_hand_plain"], rank[f"{scopes}/{how}"]
        assert (plain["breaks"], plain["graphs"]) == (0, 1)  # the model outside any scope
        assert run["breaks"] == 0, f"{scopes}/{how}: {run['breaks']} graph breaks"
        assert run["graphs"] == plain["graphs"]
        assert run["graphs_after_first_step"] == run["graphs"], "a recompile after the first step"


@pytest.mark.parametrize(("scopes", "how"), [*WHOLE_MODEL, ("sharded", "blocks"),
                                             ("sharded", "whole"), ("sharded_bf16", "blocks")])
def test_a_compiled_model_trains_to_the_weights_of_the_eager_loop_under_the_same_scopes(
        two_ranks, scopes, how):
    for rank in two_ranks:
        run, eager = rank[f"{scopes}/{how}"], rank[f"{scopes}/eager"]
        _same_weights(run["weights"], eager["weights"])
        assert run["keys"] == eager["keys"] and not any("_orig_mod" in k for k in run["keys"])


@pytest.mark.parametrize("how", ["blocks", "whole"])
def test_blocks_compiled_under_sharded_trace_as_with_fsdp2_by_hand(two_ranks, how):
    for rank in two_ranks:
        hand = rank["by_hand_fsdp_blocks"]
        for scopes in (("sharded", "sharded_bf16") if how == "blocks" else ("sharded",)):
            run = rank[f"{scopes}/{how}"]
            assert (run["breaks"], run["graphs"]) == (hand["breaks"], hand["graphs"]), scopes
            assert run["graphs_after_first_step"] == run["graphs"], "a recompile"


# ------------------------------------------------------------------------------------------------
# one process
# ------------------------------------------------------------------------------------------------
def _one_process(compile_how: str | None, scoped: bool):
    import contextlib

    import torch._dynamo
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from accel_ctx import mixed_precision

    from ..workers.sharded import GPT, tokens

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = tokens(4)[:]
    losses = []
    from accel_ctx._hooks import gates

    stock_gate, gate_calls = gates.top_level_call, []

    def counted_gate(stack, module, *args, **kwargs):
        gate_calls.append(module is model)  # the debugging backends call their own graphs too
        return stock_gate(stack, module, *args, **kwargs)

    # like the gate itself, the counter runs eagerly (Dynamo would trace this function's append)
    gates.top_level_call = torch._dynamo.disable(counted_gate, recursive=False)
    with contextlib.ExitStack() as undo:
        undo.callback(setattr, gates, "top_level_call", stock_gate)
        if scoped:
            undo.enter_context(mixed_precision("bf16"))
        if compile_how == "in_place":
            model.compile(backend=compiled.BACKEND, fullgraph=True)  # raises at a graph break
        def forward(x, y):
            return F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

        if compile_how == "function":  # the whole forward and loss, the model called inside
            forward = torch.compile(forward, backend=compiled.BACKEND)
        for _ in range(3):
            loss = forward(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    # the scope's gates ran once per top-level call of the model, never inside a graph
    assert sum(gate_calls) == (3 if scoped else 0)
    return losses, sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]


def test_a_model_compiled_in_place_inside_a_scope_makes_its_one_graph():
    eager, _, _ = _one_process(None, scoped=True)
    losses, breaks, graphs = _one_process("in_place", scoped=True)
    assert (breaks, graphs) == _one_process("in_place", scoped=False)[1:] == (0, 1)
    assert losses == eager  # bf16 autocast from the scope reaches the compiled graph


def test_a_compiled_function_that_calls_the_model_breaks_once_where_the_scope_gates_run():
    # the gates (autocast here; DDP, FSDP elsewhere) run eagerly for a top-level call: one break
    # at the call, and the model's forward is compiled below it, with the same results
    eager, _, _ = _one_process(None, scoped=True)
    losses, breaks, graphs = _one_process("function", scoped=True)
    assert _one_process("function", scoped=False)[1:] == (0, 1)
    assert breaks == 1 and graphs == 2
    assert losses == eager


def test_a_scope_does_not_import_dynamo(tmp_path):
    import subprocess
    import sys

    code = ("import sys, torch\nfrom accel_ctx import distributed, mixed_precision\n"
            "with distributed(), mixed_precision('bf16'):\n"
            "    torch.nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stderr  # importing Dynamo costs about a second


def test_the_compiled_models_wrapper_is_patched_only_while_a_scope_is_open_and_dynamo_loaded():
    import subprocess
    import sys

    # one process: Dynamo imported inside the scope, then a scope with Dynamo loaded from the start
    code = (
        "import sys, torch\n"
        "from accel_ctx import distributed\n"
        "with distributed():\n"
        "    assert 'torch._dynamo' not in sys.modules\n"
        "    model = torch.compile(torch.nn.Linear(2, 2), backend='eager')\n"
        "    from torch._dynamo.eval_frame import OptimizedModule\n"
        "    stock = OptimizedModule.__dict__['__call__']\n"
        "    model(torch.ones(1, 2))  # the first top-level call finds Dynamo loaded\n"
        "    assert OptimizedModule.__call__ is not stock\n"
        "assert OptimizedModule.__dict__['__call__'] is stock\n"
        "with distributed():\n"
        "    assert OptimizedModule.__call__ is not stock\n"
        "    model(torch.ones(1, 2)).sum().backward()\n"
        "assert OptimizedModule.__dict__['__call__'] is stock\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.stdout.strip() == "ok", out.stderr
