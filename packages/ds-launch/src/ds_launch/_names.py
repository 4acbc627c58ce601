"""What a host name and an exported variable name may be, checked wherever one enters a launch.

[Note: names that cannot inject]
A host name reaches a remote shell (pdsh substitutes it for ``%h`` in the node's command), the
argv of ``ssh`` (where a leading ``-`` is an option) and the host lists of pdsh and ``mpirun``
(where ``-host`` means "exclude", ``^file`` reads a file and ``[1-3]`` expands a range). So a
host is a name or an IP address and nothing else: letters, digits, ``-``, ``.``, ``_`` and ``:``
(IPv6), not starting with ``-``, at most 253 characters. It is checked where it is read (the
hostfile, with its path and line; ``--include``/``--exclude``; ``--master_addr``; the agent's
``--world_info``) and again before any runner's command is built, so an API caller's pool is
checked too. A variable name exported to the ranks is a shell identifier (``env NAME=VALUE``
would otherwise take ``-u=x`` as an option). Values and user arguments may hold anything: they
are quoted for the remote shell (``shlex.join``), never substituted.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_HOST = re.compile(r"[A-Za-z0-9_.:][A-Za-z0-9_.:-]*")
_MAX_HOST = 253
_VARIABLE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
HOST_RULE = (
    "a host name or IP address: letters, digits, '-', '.', '_' and ':' only, not starting with '-'"
)


def host_problem(host: str) -> str | None:
    """Why ``host`` is not a host name or IP address, or None when it is one."""
    if not host:
        return "the host name is empty"
    if len(host) > _MAX_HOST:
        return f"{len(host)} characters is longer than a host name can be ({_MAX_HOST})"
    if host.startswith("-"):
        return "it starts with '-' (runners would read it as an option)"
    if _HOST.fullmatch(host) is None:
        bad = sorted({c for c in host if not (c.isascii() and (c.isalnum() or c in "-._:"))})
        return f"it holds {', '.join(map(repr, bad))}; expected {HOST_RULE}"
    return None


def bad_host(hosts: Iterable[str]) -> tuple[str, str] | None:
    """The first of ``hosts`` that is not a host name, with the reason; None if all are."""
    for host in hosts:
        problem = host_problem(host)
        if problem is not None:
            return host, problem
    return None


def is_variable_name(name: str) -> bool:
    """Whether ``name`` is a shell variable name (``[A-Za-z_][A-Za-z0-9_]*``)."""
    return _VARIABLE.fullmatch(name) is not None
