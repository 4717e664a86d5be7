"""``accel-ctx launch`` arguments -> torchrun's arguments and the workers' environment.

Pure: reads the command line, the config files and an environment mapping; starts nothing, so
every rule here is tested without processes. :mod:`accel_ctx.cli` runs the result.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .._job import env as _env
from ..errors import ConfigurationError
from . import config as _config
from . import netif as _netif
from . import replica_groups as _replica_groups
from .nproc import check_process_count, check_replica_groups, check_torchrun_nproc, local_gpus
from .settings import CONFIG_FLAG, SETTINGS, Value, check, setting, split_host_port


def _our_flags() -> dict[str, str]:
    """Our flags -> setting key. Each '--a-b' is also '--a_b', after torchrun's habit."""
    flags = {CONFIG_FLAG: "config"}
    for s in SETTINGS:
        for flag in s.flags:
            flags[flag] = s.key
            if flag.startswith("--"):
                flags["--" + flag[2:].replace("-", "_")] = s.key
    return flags


OURS = _our_flags()
_SHORT = tuple(f for f in OURS if not f.startswith("--"))  # -n4 means -n 4, as in argparse
_EXAMPLES = {f: "my.toml" if k == "config" else setting(k).example for f, k in OURS.items()}
_TORCHRUN_NPROC = ("--nproc-per-node", "--nproc_per_node")
# torchrun flags that choose the rendezvous themselves: given any, we add no rendezvous flag.
_OWN_RENDEZVOUS = (
    "--rdzv-backend", "--rdzv_backend", "--rdzv-endpoint", "--rdzv_endpoint", "--standalone",
    "--master-addr", "--master_addr", "--master-port", "--master_port",
)
_RDZV_CONF = ("--rdzv-conf", "--rdzv_conf")
_RDZV_ID = ("--rdzv-id", "--rdzv_id")
_LOCAL_ADDR = ("--local-addr", "--local_addr")


@dataclass
class LaunchPlan:
    """What ``accel-ctx launch`` hands to torchrun, and why."""

    torchrun_args: list[str]
    """torchrun's command line: flags, then the script and its arguments."""
    env: dict[str, str] = field(default_factory=dict)
    """Variables to set before torchrun starts the workers (they inherit them)."""
    settings: dict[str, Value] = field(default_factory=dict)
    """The resolved settings (nproc as a number)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Where each setting came from: 'flag', a config file, 'SLURM' or 'default'."""
    network: _netif.NodeNetwork = field(default_factory=_netif.NodeNetwork)
    """Several nodes: the address this node advertises, its interface, what to say on failure."""
    script: list[str] = field(default_factory=list)
    """The script and its own arguments: the end of ``torchrun_args``, never parsed there."""


@dataclass
class _Parsed:
    ours: dict[str, str] = field(default_factory=dict)
    passthrough: list[tuple[str, list[str]]] = field(default_factory=list)  # (flag, tokens)
    script: list[str] = field(default_factory=list)
    help: bool = False

    def given(self, *names: str) -> bool:
        return any(flag in names for flag, _ in self.passthrough)

    def value(self, *names: str) -> str | None:
        found = None
        for flag, tokens in self.passthrough:
            if flag in names:
                found = tokens[0].partition("=")[2] if len(tokens) == 1 else tokens[1]
        return found


def wants_help(argv: Sequence[str]) -> bool | None:
    """Whether ``argv`` asks for help, told without torchrun's parser (so without torch);
    None when a torchrun flag comes first and only its parser can say."""
    i = 0
    while i < len(argv):
        name = argv[i].partition("=")[0]
        if name in ("-h", "--help"):
            return True
        if not name.startswith("-") or name in ("-", "--"):
            return False  # the script: what follows is its own
        if name in OURS:
            i += 1 if "=" in argv[i] else 2
        elif name[:2] in _SHORT:
            i += 1  # -n4
        else:
            return None
    return not argv


def parse(argv: Sequence[str], arity: Mapping[str, bool]) -> _Parsed:
    """Split the command line: our flags, torchrun's flags (``arity``: takes a value), script."""
    parsed = _Parsed()
    args = list(argv)
    i = 0
    while i < len(args):
        token = args[i]
        if token == "--":
            i += 1
            break
        if not token.startswith("-") or token == "-":
            break
        if token in ("-h", "--help"):
            parsed.help = True
            i += 1
            continue
        name, eq, inline = token.partition("=")
        if name[:2] in _SHORT and len(name) > 2:
            name, eq, inline = name[:2], "=", name[2:]
        if name in OURS:
            if eq:
                value = inline
                i += 1
            else:
                value = _value(args, i, name)
                i += 2
            parsed.ours[OURS[name]] = value
            continue
        if name not in arity:
            raise ConfigurationError(
                f"unknown option {token!r}. Options of accel-ctx and torchrun go before the "
                "script, the script's own options after it; see `accel-ctx launch --help`."
            )
        if arity[name] and not eq:
            parsed.passthrough.append((name, [token, _value(args, i, name)]))
            i += 2
        else:
            parsed.passthrough.append((name, [token]))
            i += 1
    parsed.script = args[i:]
    return parsed


def _value(args: list[str], i: int, name: str) -> str:
    if i + 1 >= len(args):
        raise ConfigurationError(f"{name} needs a value, e.g. `{name} {_EXAMPLES.get(name, 'X')}`.")
    return args[i + 1]


def plan(
    argv: Sequence[str],
    arity: Mapping[str, bool],
    environ: Mapping[str, str],
    cwd: Path | None = None,
    gpus: Callable[[], int] = local_gpus,
    route: Callable[[str, int], _netif.Route | None] | None = None,
) -> LaunchPlan:
    """Translate ``accel-ctx launch`` arguments into torchrun arguments and environment.

    ``route`` (the launcher passes :func:`accel_ctx._launch.netif.route_to`) finds how this machine
    reaches ``--master``; without it nothing is looked up and no interface is chosen.
    """
    parsed = parse(argv, arity)
    if not parsed.script:
        raise ConfigurationError(
            "give the script to run after the options, e.g. `accel-ctx launch -n 2 train.py`."
        )
    settings, sources = _resolve(parsed, environ, cwd)
    args: list[str] = []
    env: dict[str, str] = {}

    if parsed.given(*_TORCHRUN_NPROC) and "nproc" in parsed.ours:
        raise ConfigurationError(
            "-n/--nproc and torchrun's --nproc-per-node say the same thing; keep one of them."
        )
    if parsed.given(*_TORCHRUN_NPROC):
        check_torchrun_nproc(parsed.value(*_TORCHRUN_NPROC) or "", environ)
    else:
        wanted = settings.get("nproc", "auto")
        nproc = (gpus() or 1) if wanted == "auto" else int(wanted)
        where = sources.get("nproc", "flag")
        check_process_count(nproc, f"-n {nproc}" if where == "flag" else
                            f"nproc = {nproc} (in {where})", environ)
        settings["nproc"] = nproc
        args += ["--nproc-per-node", str(nproc)]
    groups = int(settings.get("replica_groups", 1))
    if groups > 1 and "lighthouse" not in settings:  # every group on this machine
        per_group = (settings["nproc"] if not parsed.given(*_TORCHRUN_NPROC)
                     else parsed.value(*_TORCHRUN_NPROC) or "")
        # torchrun's words (auto, gpu...) count the devices; one per group is the least
        check_replica_groups(groups, int(per_group) if str(per_group).isdigit() else 1, environ)
    nnodes = settings.get("nnodes", 1)
    args += ["--nnodes", str(nnodes)]
    max_nodes = int(str(nnodes).rsplit(":", 1)[-1])
    meet, network = _rendezvous(parsed, settings, sources, max_nodes, env, environ, route)
    args += meet
    if "max_restarts" in settings:
        args += ["--max-restarts", str(settings["max_restarts"])]
    if "mixed_precision" in settings:
        env[_env.MIXED_PRECISION_VAR] = str(settings["mixed_precision"])
    env.update(_replica_groups.group_env(settings))  # --lighthouse: one replica group's launcher
    for _, tokens in parsed.passthrough:
        args += tokens
    return LaunchPlan([*args, *parsed.script], env, settings, sources, network,
                      list(parsed.script))


def _resolve(
    parsed: _Parsed, environ: Mapping[str, str], cwd: Path | None
) -> tuple[dict[str, Value], dict[str, str]]:
    """Each setting from the first of :data:`.config.PRECEDENCE` that gives it."""
    config = _config.load(parsed.ours.get("config"), cwd=cwd, environ=environ)
    settings = dict(config.values)
    sources = dict(config.sources)
    for key, value in _env.slurm_nodes(environ).items():
        settings[key], sources[key] = check(key, value, f"SLURM's {key}"), "SLURM"
    for key, raw in parsed.ours.items():
        if key != "config":
            settings[key], sources[key] = check(key, raw, setting(key).flag), "flag"
    return settings, sources


def _rendezvous(
    parsed: _Parsed,
    settings: Mapping[str, Value],
    sources: Mapping[str, str],
    max_nodes: int,
    env: dict[str, str],
    environ: Mapping[str, str],
    route: Callable[[str, int], _netif.Route | None] | None,
) -> tuple[list[str], _netif.NodeNetwork]:
    node_rank = int(settings["node_rank"]) if "node_rank" in settings else None
    if node_rank is not None and node_rank >= max_nodes:
        raise ConfigurationError(
            f"--node-rank {node_rank} with {max_nodes} node(s): node ranks run from 0 to "
            f"{max_nodes - 1}; give each machine its own."
        )
    if parsed.given(*_OWN_RENDEZVOUS):  # the user drives torchrun's rendezvous directly
        if sources.get("master") == "flag":
            raise ConfigurationError(
                "--master and torchrun's rendezvous flags (--rdzv-endpoint, --master-addr, "
                "--standalone, ...) both choose where the nodes meet; keep one of them."
            )
        static = [] if node_rank is None else ["--node-rank", str(node_rank)]  # static's meaning
        return static, _netif.NodeNetwork()
    args: list[str] = []
    network = _netif.NodeNetwork()
    conf = parsed.value(*_RDZV_CONF) or ""
    master = str(settings["master"]) if "master" in settings else None
    if master is not None:
        host, port = split_host_port(master) or ("", 0)
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", master]
        if not parsed.given(*_RDZV_ID):
            job = environ.get("SLURM_JOB_ID")
            args += ["--rdzv-id", f"slurm-{job}" if sources.get("master") == "SLURM" and job
                     else "accel-ctx"]
        if node_rank is not None and "is_host=" not in conf:
            # Node 0 hosts the rendezvous store. Saying so beats torchrun's guess from the
            # host name, which fails when --master is an IP address or an alias.
            conf = ",".join(filter(None, (conf, f"is_host={'true' if node_rank == 0 else 'false'}")))
        # Advertise an address the other nodes reach (torchrun's default is this machine's
        # host name, often loopback in containers), and give gloo / NCCL the interface that
        # leads to the master (they too pick one from the host name).
        found = route(host, port) if route is not None else None
        network = _netif.node_network(host, port, node_rank, found, environ,
                                      looked_up=route is not None)
        env.update(network.env)
    elif max_nodes > 1:
        raise ConfigurationError(
            f"{max_nodes} nodes need a meeting point: add --master HOST:PORT with the address "
            "of node 0 and a free port, the same on every node (or set `master` with "
            "`accel-ctx config`)."
        )
    else:
        # One machine: meet on loopback, on a port the OS picks, under a fresh id. Nothing is
        # looked up by host name, and two jobs on one machine never collide. (torch's TCPStore
        # still listens on every interface; every address advertised and dialled is loopback.)
        args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0",
                 "--rdzv-id", uuid.uuid4().hex]
        network.local_addr = "127.0.0.1"
        ifname = _netif.loopback_interface()
        if ifname and "GLOO_SOCKET_IFNAME" not in environ:
            env["GLOO_SOCKET_IFNAME"] = ifname  # gloo's connections on loopback too
    if network.local_addr and not parsed.given(*_LOCAL_ADDR):
        args += ["--local-addr", network.local_addr]  # where workers reach the store
    if parsed.given(*_RDZV_CONF) or conf:
        # the merged value replaces the user's own --rdzv-conf in the pass-through flags
        parsed.passthrough = [p for p in parsed.passthrough if p[0] not in _RDZV_CONF]
        args += ["--rdzv-conf", conf]
    return args, network

