"""torchrun's agent as nsa-diag starts it: ``python -m nsa_diag.worker.agent <torchrun's arguments>``.

This is torchrun (``torch.distributed.run``), with two things its command line cannot ask for:

1. it dies with nsa-diag (`nsa_diag.worker.tether.hold`); each rank holds its own tether to the agent;
2. its TCPStore listens on the rendezvous address only. torch's store server binds the wildcard address
   whatever host it is given: the libuv backend (the default) binds ``::`` (which takes IPv4 as well) or
   ``0.0.0.0`` (``UvTcpServer::makeWithPort``), the older backend ``getaddrinfo(NULL, AI_PASSIVE)``. The
   one way to choose the address is ``master_listen_fd``, a socket already bound and listening that the
   server adopts, and no rendezvous handler passes one (``static_tcp_rendezvous``, ``c10d``'s store,
   the dynamic handler's shared store). So `bind_stores` puts `BoundTCPStore` in the place of torch's
   TCPStore in the modules that use it; a store server it creates listens on the host it is told (the
   single-node default ``--master-addr 127.0.0.1``; a multi-node ``--rdzv-endpoint`` host; the dynamic
   handler's node address). The store has no authentication, so loopback is what keeps it private.

The ranks (`nsa_diag.worker.ddp`) call `bind_stores` too: normally only the agent serves (the ranks share
its store), but with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` rank 0 serves one of its own.
"""

from __future__ import annotations

import contextlib
import importlib
import socket
import sys
from typing import Any

import torch.distributed as dist

from nsa_diag.worker import tether

_ARGUMENTS = ("host_name", "port", "world_size", "is_master", "timeout", "wait_for_workers", "multi_tenant")
_ORIGINAL = dist.TCPStore
_TAKE_TCPSTORE = (  # the modules of torchrun and of env:// that import TCPStore by name
    "torch.distributed.rendezvous",
    "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
)


def bind_listener(host: str, port: int) -> int:
    """A TCP socket bound to ``host:port`` (its first address) and listening; its descriptor, which the
    caller owns (close-on-exec, as Python makes every socket)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's own listener does
        sock.bind(address)
        sock.listen(socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock.detach()


class BoundTCPStore(_ORIGINAL):  # type: ignore[misc, valid-type]
    """torch's TCPStore, whose server (``is_master``) listens on ``host_name`` only (module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = {**dict(zip(_ARGUMENTS, args, strict=False)), **kwargs}
        if len(args) > len(_ARGUMENTS) or not given.get("is_master") or given.get("master_listen_fd"):
            super().__init__(*args, **kwargs)
            return
        # A port taken already is this process's own multi-tenant server (which torch then reuses, bound
        # by us already) or another process's (and torch fails as it would have).
        with contextlib.suppress(OSError):
            given["master_listen_fd"] = bind_listener(str(given["host_name"]), int(given["port"]))
        super().__init__(**given)


def bind_stores() -> None:
    """`BoundTCPStore` in the place of torch's TCPStore: in ``torch.distributed`` (for the modules that
    import it later) and in every ``torch.distributed`` module loaded now that took it by name."""
    for name in _TAKE_TCPSTORE:  # loaded now, so that the loop below finds them
        importlib.import_module(name)

    for name, module in list(sys.modules.items()):
        if name.startswith("torch.distributed") and getattr(module, "TCPStore", None) is _ORIGINAL:
            module.TCPStore = BoundTCPStore


def main() -> None:
    tether.hold()
    bind_stores()
    from torch.distributed.run import main as torchrun

    torchrun()  # parses sys.argv[1:], as ``python -m torch.distributed.run`` does


if __name__ == "__main__":
    main()
