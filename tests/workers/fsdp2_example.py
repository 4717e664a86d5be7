"""pytorch/examples' ``distributed/FSDP2`` example (``example.py``, ``checkpoint.py``, ``model.py``,
``utils.py``), kept call by call, small: by hand (``fully_shard`` on each layer, then the model)
and migrated to ``sharded()`` (the ``fully_shard`` calls and the ``MixedPrecisionPolicy`` removed,
``mixed_precision("bf16")`` for ``--mixed-precision``), in the same spawned run.

The example builds its model on ``meta``, reads its placements (``inspect_model``), sets FSDP2's
explicit prefetching on the layers, then either gives it memory and values (``to_empty`` and
``reset_parameters()``) or loads the last full checkpoint through its ``Checkpointer`` (DCP's
``set_model_state_dict`` broadcast from rank 0, or DTensors built from ``model.state_dict()``'s
meshes and placements, loaded with ``assign=True``), checks the gathered dtype
(``unshard()``/``reshard()``), trains, clips, and saves full state dicts from rank 0. Each
configuration runs twice: from scratch, then from the checkpoint the first run wrote.

Two changes to the example, both needed by either side: the example resets only the root's own
modules (``model.reset_parameters()``), leaving the layers' weights at ``to_empty``'s
uninitialised memory, so the layers are reset too; and ``inspect_model`` asserts
``isinstance(model, FSDPModule)`` after reading the parameters (under ``sharded()`` the model is
FSDP2's from its first touch on).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from accel_ctx import distributed, mixed_precision, sharded, state

from .._timeouts import scaled
from .common import hand_group

# ---- model.py --------------------------------------------------------------------------------


@dataclass
class ModelArgs:
    n_layers: int = 2
    vocab_size: int = 8
    max_seq_len: int = 16
    dim: int = 16
    n_heads: int = 4
    dropout_p: float = 0.1


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        assert args.dim % args.n_heads == 0
        self.head_dim = args.dim // args.n_heads
        self.n_heads = args.n_heads
        self.dropout_p = args.dropout_p
        self.resid_dropout = nn.Dropout(args.dropout_p)
        self.wq = nn.Linear(args.dim, args.dim, bias=False)
        self.wk = nn.Linear(args.dim, args.dim, bias=False)
        self.wv = nn.Linear(args.dim, args.dim, bias=False)
        self.wo = nn.Linear(args.dim, args.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.size()
        queries, keys, values = self.wq(x), self.wk(x), self.wv(x)
        queries = queries.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        keys = keys.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        values = values.view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        output = F.scaled_dot_product_attention(
            queries, keys, values, None, self.dropout_p if self.training else 0)
        output = output.transpose(1, 2).contiguous().view(bsz, seq_len, -1)
        return self.resid_dropout(self.wo(output))

    def reset_parameters(self) -> None:
        self.wq.reset_parameters()
        self.wk.reset_parameters()
        self.wv.reset_parameters()
        self.wo.reset_parameters()


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout_p: float) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim)
        self.gelu = nn.GELU()
        self.w2 = nn.Linear(hidden_dim, dim)
        self.resid_dropout = nn.Dropout(dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.w2(self.gelu(self.w1(x))))

    def reset_parameters(self) -> None:
        self.w1.reset_parameters()
        self.w2.reset_parameters()


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(args.dim)
        self.attention = Attention(args)
        self.ffn_norm = nn.LayerNorm(args.dim)
        self.feed_forward = FeedForward(args.dim, hidden_dim=4 * args.dim,
                                        dropout_p=args.dropout_p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))

    def reset_parameters(self) -> None:
        self.attention_norm.reset_parameters()
        self.attention.reset_parameters()
        self.ffn_norm.reset_parameters()
        self.feed_forward.reset_parameters()


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.model_args = args
        self.max_seq_len = args.max_seq_len
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos_embeddings = nn.Embedding(args.max_seq_len, args.dim)
        self.dropout = nn.Dropout(args.dropout_p)
        self.layers = nn.ModuleList()
        for _ in range(args.n_layers):
            self.layers.append(TransformerBlock(args))
        self.norm = nn.LayerNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _bsz, seq_len = tokens.size()
        assert seq_len <= self.max_seq_len
        h = self.tok_embeddings(tokens)
        pos = torch.arange(0, seq_len, device=tokens.device)
        h = h + self.pos_embeddings(pos)
        h = self.dropout(h)
        for layer in self.layers:
            h = layer(h)
        h = self.norm(h)
        return self.output(h).float()

    def reset_parameters(self) -> None:
        self.tok_embeddings.reset_parameters()
        self.pos_embeddings.reset_parameters()
        self.norm.reset_parameters()
        self.output.reset_parameters()


# ---- utils.py --------------------------------------------------------------------------------


def inspect_model(model: nn.Module) -> list[str]:
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import Shard

    assert isinstance(model, Transformer)
    seen = []
    for param in model.parameters():
        assert param.placements == (Shard(0),)  # type: ignore[attr-defined]
        assert param.dtype == torch.float32
        seen.append(f"{type(param).__name__}:{param.placements}:{param.device.type}")  # type: ignore[attr-defined]
    assert isinstance(model, FSDPModule)
    return seen


def inspect_mixed_precision(model: Any) -> list[str]:
    model.unshard()
    dtypes = [str(param.dtype) for param in model.parameters(recurse=False)]
    for param in model.parameters(recurse=False):
        assert param.dtype == torch.bfloat16
    model.reshard()
    return dtypes


def get_latest_checkpoint_folder(path: str) -> int | None:
    max_num = None
    if not os.path.exists(path):
        return max_num
    for name in os.listdir(path):
        if os.path.isdir(os.path.join(path, name)):
            try:
                num = int(name)
                if max_num is None or num > max_num:
                    max_num = num
            except ValueError:
                pass
    return max_num


# ---- checkpoint.py ---------------------------------------------------------------------------

MODEL_CHECKPOINT = "model_state_dict.pt"
OPTIM_CHECKPOINT = "optim_state_dict.pt"


class Checkpointer:
    def __init__(self, folder: str, dcp_api: bool) -> None:
        self.folder = folder
        self.dcp_api = dcp_api
        self.last_training_time = get_latest_checkpoint_folder(f"{folder}/{self._api}")

    @property
    def _api(self) -> str:
        return "dcp_api" if self.dcp_api else "dtensor_api"

    def load_model(self, model: nn.Module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
        from torch.distributed.tensor import distribute_tensor

        last = f"{self.folder}/{self._api}/{self.last_training_time}/{MODEL_CHECKPOINT}"
        full_sd = torch.load(last, mmap=True, weights_only=True, map_location="cpu")
        if self.dcp_api:
            set_model_state_dict(model=model, model_state_dict=full_sd, options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True))
            return
        meta_sharded_sd = model.state_dict()
        sharded_sd = {}
        for param_name, full_tensor in full_sd.items():
            sharded_meta_param = meta_sharded_sd.get(param_name)
            sharded_tensor = distribute_tensor(full_tensor, sharded_meta_param.device_mesh,
                                               sharded_meta_param.placements)
            sharded_sd[param_name] = nn.Parameter(sharded_tensor)
        # choose `assign=True` since we cannot call `copy_` on meta tensor
        model.load_state_dict(sharded_sd, strict=False, assign=True)

    def load_optim(self, model: nn.Module, opt: torch.optim.Optimizer) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            _init_optim_state,
            set_optimizer_state_dict,
        )
        from torch.distributed.tensor import DTensor, distribute_tensor

        last = f"{self.folder}/{self._api}/{self.last_training_time}/{OPTIM_CHECKPOINT}"
        full_sd = torch.load(last, mmap=True, weights_only=True, map_location="cpu")
        if self.dcp_api:
            set_optimizer_state_dict(model=model, optimizers=opt, optim_state_dict=full_sd,
                                     options=StateDictOptions(full_state_dict=True,
                                                              broadcast_from_rank0=True))
            return
        _init_optim_state(opt)
        param_groups = opt.state_dict()["param_groups"]
        opt_state = opt.state_dict()["state"]
        full_param_groups = full_sd["param_groups"]
        full_state = full_sd["state"]
        for param_group, full_param_group in zip(param_groups, full_param_groups, strict=True):
            for key, value in full_param_group.items():
                if key == "params":
                    continue
                param_group[key] = value
            for pid, full_pid in zip(param_group["params"], full_param_group["params"],
                                     strict=False):
                if pid not in opt_state:
                    continue
                param_state = opt_state[pid]
                full_param_state = full_state[full_pid]
                for attr, full_tensor in full_param_state.items():
                    sharded_tensor = param_state[attr]
                    if isinstance(sharded_tensor, DTensor):
                        param_state[attr] = distribute_tensor(
                            full_tensor, sharded_tensor.device_mesh, sharded_tensor.placements)
                    else:
                        param_state[attr] = full_tensor
        opt.load_state_dict({"param_groups": param_groups, "state": opt_state})

    def _get_full_model_state_dict(self, model: nn.Module) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self.dcp_api:
            return get_model_state_dict(model=model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        sharded_sd = model.state_dict()
        cpu_state_dict = {}
        for param_name, sharded_param in sharded_sd.items():
            full_param = sharded_param.full_tensor()
            if dist.get_rank() == 0:
                cpu_state_dict[param_name] = full_param.cpu()
            else:
                del full_param
        return cpu_state_dict

    def _get_full_optimizer_state_dict(self, model: nn.Module, opt: torch.optim.Optimizer
                                       ) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_optimizer_state_dict,
        )
        from torch.distributed.tensor import DTensor

        if self.dcp_api:
            return get_optimizer_state_dict(model=model, optimizers=opt, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        is_rank_zero = dist.get_rank() == 0
        sharded_sd = opt.state_dict()
        full_state = {}
        for group_id, sharded_group in sharded_sd["state"].items():
            group_state = {}
            for attr, sharded_tensor in sharded_group.items():
                if isinstance(sharded_tensor, DTensor):
                    full_tensor = sharded_tensor.full_tensor()
                else:
                    full_tensor = sharded_tensor
                if is_rank_zero:
                    group_state[attr] = full_tensor.cpu()
            if is_rank_zero:
                full_state[group_id] = group_state
        if is_rank_zero:
            return {"param_groups": sharded_sd["param_groups"], "state": full_state}
        return {}

    def save(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        model_state_dict = self._get_full_model_state_dict(model)
        optim_state_dict = self._get_full_optimizer_state_dict(model, optim)
        if dist.get_rank() == 0:
            new_training_time = int(time.time() * 1000)
            while os.path.exists(f"{self.folder}/{self._api}/{new_training_time}"):
                new_training_time += 1  # two runs within a millisecond (the example's runs are not)
            new_checkpoint_folder = f"{self.folder}/{self._api}/{new_training_time}"
            os.makedirs(new_checkpoint_folder, exist_ok=True)
            torch.save(model_state_dict, f"{new_checkpoint_folder}/{MODEL_CHECKPOINT}")
            torch.save(optim_state_dict, f"{new_checkpoint_folder}/{OPTIM_CHECKPOINT}")


# ---- example.py ------------------------------------------------------------------------------


def set_modules_to_forward_prefetch(model: Any, num_to_forward_prefetch: int) -> None:
    for i, layer in enumerate(model.layers):
        if i >= len(model.layers) - num_to_forward_prefetch:
            break
        layers_to_prefetch = [model.layers[i + j] for j in range(1, num_to_forward_prefetch + 1)]
        layer.set_modules_to_forward_prefetch(layers_to_prefetch)


def set_modules_to_backward_prefetch(model: Any, num_to_backward_prefetch: int) -> None:
    for i, layer in enumerate(model.layers):
        if i < num_to_backward_prefetch:
            continue
        layers_to_prefetch = [model.layers[i - j] for j in range(1, num_to_backward_prefetch + 1)]
        layer.set_modules_to_backward_prefetch(layers_to_prefetch)


@dataclass(frozen=True)
class Args:
    explicit_prefetching: bool = False
    mixed_precision: bool = False
    dcp_api: bool = False
    train_order: bool = False
    """train.py's order: values (or the checkpoint) first, then inspect, prefetching, optimizer."""
    methods_first: bool = False
    """FSDP2's prefetching set before anything else touches the model."""


VOCAB, BATCH, SEQ, STEPS = 64, 4, 16, 3


def main(args: Args, folder: str, by_hand: bool) -> dict[str, Any]:
    """The example's main(), ``fully_shard`` and its policy only when ``by_hand``; what it
    showed on the way (placements, dtypes, losses) comes back for the comparison."""
    device = torch.device("cpu") if by_hand else state().device
    torch.manual_seed(0)
    model_args = ModelArgs(n_layers=4, n_heads=4, vocab_size=VOCAB, max_seq_len=SEQ,
                           dropout_p=0)
    with torch.device("meta"):
        model: Any = Transformer(model_args)
    if by_hand:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        fsdp_kwargs: dict[str, Any] = {}
        if args.mixed_precision:
            fsdp_kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                            reduce_dtype=torch.float32)
        for layer in model.layers:
            fully_shard(layer, **fsdp_kwargs)
        fully_shard(model, **fsdp_kwargs)
    out: dict[str, Any] = {}
    if args.methods_first:
        set_modules_to_forward_prefetch(model, num_to_forward_prefetch=2)
        set_modules_to_backward_prefetch(model, num_to_backward_prefetch=2)
    if not args.train_order:
        out["placements"] = inspect_model(model)
        if args.explicit_prefetching:
            set_modules_to_forward_prefetch(model, num_to_forward_prefetch=2)
            set_modules_to_backward_prefetch(model, num_to_backward_prefetch=2)
    checkpointer = Checkpointer(folder, dcp_api=args.dcp_api)
    out["resumed"] = checkpointer.last_training_time is not None
    if checkpointer.last_training_time is None:
        model.to_empty(device=device)
        model.reset_parameters()
        for layer in model.layers:  # see the module's docstring
            layer.reset_parameters()
    else:
        checkpointer.load_model(model)
    if args.train_order:
        out["placements"] = inspect_model(model)
    if args.mixed_precision:
        out["gathered"] = inspect_mixed_precision(model)
    if args.train_order and args.explicit_prefetching:
        set_modules_to_forward_prefetch(model, num_to_forward_prefetch=2)
        set_modules_to_backward_prefetch(model, num_to_backward_prefetch=2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    if checkpointer.last_training_time is not None:
        checkpointer.load_optim(model, optim)
    dist.barrier()
    losses = []
    for _ in range(STEPS):
        if args.explicit_prefetching:
            model.unshard()
        x = torch.randint(0, VOCAB, (BATCH, SEQ), device=device)
        loss = model(x).sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    checkpointer.save(model, optim)
    dist.barrier()
    out["losses"] = losses
    return out


CONFIGS = {
    "dtensor": Args(),
    "dcp": Args(dcp_api=True),
    "dcp prefetch bf16": Args(explicit_prefetching=True, mixed_precision=True, dcp_api=True),
    "dtensor bf16": Args(mixed_precision=True),
    # train.py's order: to_empty(), or the Checkpointer's state_dict()/DCP call, touches first
    "train.py dcp prefetch": Args(dcp_api=True, explicit_prefetching=True, train_order=True),
    "train.py dtensor": Args(train_order=True),
}
METHODS_FIRST = {"dtensor methods first": Args(explicit_prefetching=True, methods_first=True)}
"""Needs FSDP2's method names answered by nn.Module.__getattr__'s misses (_engines.touch)."""


def _saved(folder: str, args: Args) -> dict[str, Any]:
    """What the last run saved (rank 0's files), read on every rank."""
    api = "dcp_api" if args.dcp_api else "dtensor_api"
    last = f"{folder}/{api}/{get_latest_checkpoint_folder(f'{folder}/{api}')}"
    return {"model": torch.load(f"{last}/{MODEL_CHECKPOINT}", weights_only=True),
            "optim": torch.load(f"{last}/{OPTIM_CHECKPOINT}", weights_only=True)}


@contextlib.contextmanager
def _migrated(args: Args) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        stack.enter_context(distributed(timeout=scaled(60)))
        stack.enter_context(sharded())
        if args.mixed_precision:
            stack.enter_context(mixed_precision("bf16"))
        yield


def example(folder: str, names: list[str]) -> dict[str, Any]:
    """Each configuration twice (from scratch, then resumed), by hand and under sharded(); then
    what FSDP2's methods say where the model is not sharded."""
    out: dict[str, Any] = {"messages": messages()}
    for name in names:
        args = {**CONFIGS, **METHODS_FIRST}[name]
        for side in ("by hand", "sharded()"):
            where = os.path.join(folder, name.replace(" ", "-"), side.strip("()").replace(" ", "-"))
            for run in ("fresh", "resumed"):
                scope = hand_group("fsdp2-example") if side == "by hand" else _migrated(args)
                try:
                    with scope:
                        result = main(args, where, by_hand=side == "by hand")
                except Exception as exc:  # reported per run, the other runs still go on
                    out[f"{name} / {side} / {run}"] = {"error": f"{type(exc).__name__}: {exc}"}
                    continue
                result["saved"] = _saved(where, args)
                out[f"{name} / {side} / {run}"] = result
    return out


def messages() -> dict[str, str | None]:
    """FSDP2's methods where the model is not sharded: each says why and what to do."""

    def error_of(fn: Any) -> str | None:
        try:
            fn()
        except AttributeError as exc:
            return str(exc)
        return None

    from accel_ctx import on_main_process

    small = ModelArgs(n_layers=2, vocab_size=VOCAB, dropout_p=0)
    out: dict[str, str | None] = {}
    with distributed(timeout=scaled(60)):
        model: Any = Transformer(small)
        out["ddp"] = error_of(lambda: model.unshard())
    with distributed(timeout=scaled(60)), sharded():
        model = Transformer(small)
        out["rank_only"] = error_of(lambda: on_main_process(lambda: model.unshard())())
        out["hasattr"] = str(hasattr(model, "reshard"))  # sharded now, on every rank
        out["inner"] = error_of(lambda: model.layers[0].attention.set_modules_to_forward_prefetch([]))
        out["block"] = error_of(lambda: model.layers[0].set_modules_to_forward_prefetch([]))
    return out
