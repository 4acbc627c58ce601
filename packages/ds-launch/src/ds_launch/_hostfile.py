"""Hostfiles (``hostname slots=N``, MPI style) and ``.deepspeed_env`` files."""

from __future__ import annotations

import re

from ds_launch._names import host_problem, is_variable_name
from ds_launch.api import HostfileError, LaunchError

_HOST_LINE = re.compile(r"(?P<host>[^\s=#]+)\s+slots\s*=\s*(?P<slots>\S+)")


def _lines(path: str, error: type[LaunchError], what: str) -> list[str]:
    try:
        with open(path, encoding="utf-8") as fd:
            return fd.read().splitlines()
    except FileNotFoundError:
        raise error(f"{what} {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise error(f"cannot read {what} {path}: {exc}") from None


def parse_hostfile(path: str) -> dict[str, int]:
    """Read a hostfile into ``{host: slots}``, in file order.

    Each line is ``hostname slots=N``; ``#`` starts a comment, blank lines are skipped.

    Raises:
        HostfileError: the file is missing or empty, or a line is malformed, names something
            that is not a host name or IP address (letters, digits, ``-._:``, not starting with
            ``-``), repeats a host, or has a non-integer or zero slot count; the message names
            the file, the line and its text.

    Example:
        >>> parse_hostfile("hosts")  # "worker-1 slots=4\\nworker-2 slots=4  # spare\\n"
        {'worker-1': 4, 'worker-2': 4}
    """
    pool: dict[str, int] = {}
    first_line: dict[str, int] = {}
    for number, raw in enumerate(_lines(path, LaunchError, "hostfile"), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOST_LINE.fullmatch(line)
        if match is None:
            raise HostfileError(
                path, number, f"{raw.strip()!r} is not `hostname slots=N` (e.g. worker-1 slots=8)"
            )
        host, slots = match.group("host"), match.group("slots")
        problem = host_problem(host)
        if problem is not None:  # see [Note: names that cannot inject]
            raise HostfileError(path, number, f"{raw.strip()!r}: {host!r} is refused: {problem}")
        if host in pool:
            raise HostfileError(
                path, number, f"host {host!r} is listed again (first on line {first_line[host]})"
            )
        if not slots.isdigit():
            raise HostfileError(
                path, number, f"slots={slots} for {host!r} is not a positive integer"
            )
        if int(slots) == 0:
            raise HostfileError(
                path, number, f"slots=0 for {host!r}: give it >= 1 slot or remove the line"
            )
        pool[host] = int(slots)
        first_line[host] = number
    if not pool:
        raise HostfileError(path, 0, "no hosts (expected `hostname slots=N` lines)")
    return pool


def parse_env_file(path: str) -> dict[str, str]:
    """Read a ``.deepspeed_env`` file: ``NAME=VALUE`` lines, ``#`` comments and blank lines.

    Names and values are stripped of surrounding blanks; values are taken literally (no shell
    unquoting), as DeepSpeed does.

    Raises:
        LaunchError: the file cannot be read, a line has no ``NAME=``, or the name is not a
            shell variable name; names file and line.
    """
    values: dict[str, str] = {}
    for number, raw in enumerate(_lines(path, LaunchError, "env file"), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, value = line.partition("=")
        name = name.strip()
        if not sep or not name or any(c.isspace() for c in name):
            raise LaunchError(f"{path}:{number}: {raw.strip()!r} is not NAME=VALUE")
        if not is_variable_name(name):
            raise LaunchError(
                f"{path}:{number}: {raw.strip()!r}: {name!r} is not a variable name "
                "(letters, digits and '_', not starting with a digit)"
            )
        values[name] = value.strip()
    return values
