"""Which local address and network interface reach a host: for ``accel-ctx launch`` on
several machines.

torchrun's rendezvous advertises each node by its host name, and gloo picks its interface
from the host name too; where the host name resolves to loopback (many containers) the nodes
then never meet. The launcher instead asks the kernel's routing table: a UDP ``connect()``
sends nothing but picks the source address that reaches the master, and the interface holding
that address is the one gloo / NCCL must use. Standard library only; Linux first (ioctl,
``/proc``), ``ip -o addr`` as a fallback; None where it cannot tell.
"""

from __future__ import annotations

import contextlib
import ipaddress
import shutil
import socket
import struct
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

_SIOCGIFADDR = 0x8915  # Linux: the IPv4 address of an interface


@dataclass(frozen=True)
class Route:
    """How this machine reaches a host: its own address on that path, and the interface."""

    address: str
    interface: str | None

    @property
    def is_loopback(self) -> bool:
        with contextlib.suppress(ValueError):
            return ipaddress.ip_address(self.address.split("%")[0]).is_loopback
        return False


def route_to(host: str, port: int) -> Route | None:
    """The local address (and its interface) this machine uses to reach ``host``; None if
    the host does not resolve or no route leads there. Sends no packet.

    Examples:
        >>> route_to("127.0.0.1", 29500).address
        '127.0.0.1'
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return None
    for family, _, _, _, sockaddr in infos:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(sockaddr)
                local = str(probe.getsockname()[0])
        except OSError:
            continue
        return Route(local, interface_of(local))
    return None


def interface_of(address: str) -> str | None:
    """The name of the interface holding ``address`` ('eth0', 'lo', ...), or None."""
    try:
        wanted = ipaddress.ip_address(address.split("%")[0])
    except ValueError:
        return None
    finders = (_ioctl_v4, _ip_addr) if wanted.version == 4 else (_proc_v6, _ip_addr)
    for find in finders:
        with contextlib.suppress(OSError, ValueError, subprocess.SubprocessError):
            name = find(wanted)
            if name:
                return name
    return None


def _ioctl_v4(wanted: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    if sys.platform != "linux":
        return None
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue  # no IPv4 address on this interface
            if ipaddress.ip_address(reply[20:24]) == wanted:
                return name
    return None


def _proc_v6(wanted: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    with open("/proc/net/if_inet6", encoding="ascii") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and ipaddress.IPv6Address(int(fields[0], 16)) == wanted:
                return fields[5]
    return None


def _ip_addr(wanted: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """``ip -o addr`` lists every address, secondary ones too: "2: eth0    inet 10.0.0.2/24 ..."."""
    tool = shutil.which("ip")
    if tool is None:
        return None
    out = subprocess.run([tool, "-o", "addr", "show"], capture_output=True, text=True,
                         timeout=5, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        if (len(fields) >= 4 and fields[2] in ("inet", "inet6")
                and ipaddress.ip_interface(fields[3]).ip == wanted):
            return fields[1].split("@")[0]
    return None


def loopback_interface() -> str | None:
    """The name of the loopback network interface ('lo' on Linux, 'lo0' on macOS), if any."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except (OSError, AttributeError):
        return None
    return next((n for n in ("lo", "lo0") if n in names), None)


def is_loopback_host(host: str) -> bool:
    """'localhost', '::1' and 127.x.y.z: the host itself, without a lookup."""
    return host in ("localhost", "::1") or host.startswith("127.")


@dataclass
class NodeNetwork:
    """What one node of a multi-node launch advertises and which interface its workers use."""

    local_addr: str | None = None
    """torchrun's ``--local-addr``: where the other nodes reach this node's store."""
    env: dict[str, str] = field(default_factory=dict)
    """GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to set (only those the user has not set)."""
    note: str = ""
    """Said when the nodes fail to connect: the addresses this side tried."""
    warning: str = ""
    """Said at once: a setup that cannot work (the master resolves to loopback here)."""


def node_network(
    host: str, port: int, node_rank: int | None, route: Route | None,
    environ: Mapping[str, str], looked_up: bool,
) -> NodeNetwork:
    """Choose this node's advertised address and interface from the route to the master.

    Node 0 advertises the master address (the other nodes reach it there already); another
    node advertises its own address on the path to the master. gloo and NCCL get the
    interface of that path unless the user named one. ``looked_up``: ``route`` is the
    answer of :func:`route_to` (False: no lookup was made, choose without it).
    """
    net = NodeNetwork()
    loopback = is_loopback_host(host)
    if loopback:
        net.local_addr = "127.0.0.1"  # every node on this machine: the store is at 127.0.0.1
    elif node_rank == 0:
        net.local_addr = host
    elif route is not None and not route.is_loopback:
        net.local_addr = route.address
    if not looked_up:
        return net
    ifname = route.interface if route is not None else None
    if route is not None and route.is_loopback and not loopback:
        net.warning = (
            f"--master {host}:{port} resolves to {route.address} (loopback) on this machine, "
            "where the other nodes cannot reach it; give --master the address of node 0 that "
            "every node reaches (e.g. its IP), or set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME "
            "to the interface the nodes share."
        )
        ifname = None
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if ifname and not environ.get(var):
            net.env[var] = ifname
    where = (f"from {route.address} (interface {route.interface or '?'})" if route is not None
             else "(no route to it was found from this machine)")
    chosen = {var: environ.get(var) or net.env.get(var) for var in ("GLOO_SOCKET_IFNAME",)}
    net.note = (
        f" This node (node rank {'?' if node_rank is None else node_rank}) reaches the master "
        f"{host}:{port} {where}, advertised {net.local_addr or 'its host name'} to the other "
        f"nodes, and its workers use interface {chosen['GLOO_SOCKET_IFNAME'] or 'chosen by gloo'}"
        ". Every node must reach the others at the addresses they advertise: check firewalls, "
        "and set GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (or torchrun's --local-addr) if the "
        "wrong interface was chosen."
    )
    return net
