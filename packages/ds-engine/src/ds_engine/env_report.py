"""``deepspeed.env_report``: the ``ds_report`` command: op builders, then the environment.

``ds_report [--hide_operator_status] [--hide_errors_and_warnings]`` as in DeepSpeed: the first
table lists every op builder of ``deepspeed.ops.op_builder`` with whether it runs here (and, not
hidden, why not); the second is ds-engine's environment report (``ds-report``).
"""

from __future__ import annotations

import argparse

from ds_engine._report import collect, format_report

__all__ = ["cli_main", "main", "op_report"]


def op_report(verbose: bool = True) -> str:
    """One line per op builder: its name, ``[OKAY]``/``[NO]`` and, with ``verbose``, why not."""
    from ds_engine.ops.op_builder.all_ops import ALL_OPS

    width = max(len(name) for name in ALL_OPS)
    lines = ["ds op report (DeepSpeed op builders; ds compiles nothing at run time)", "-" * 72]
    for name, builder in sorted(ALL_OPS.items()):
        reason = builder._incompatible_reason()
        line = f"{name:<{width}}  {'[OKAY]' if reason is None else '[NO]  '}"
        line += f"  {builder.absolute_name()}" if reason is None else ""
        if reason is not None and verbose:
            line += f"  {reason}"
        lines.append(line.rstrip())
    return "\n".join(lines)


def main(hide_operator_status: bool = False, hide_errors_and_warnings: bool = False) -> None:
    """Print the op report (unless hidden), then the environment report."""
    if not hide_operator_status:
        print(op_report(verbose=not hide_errors_and_warnings))
        print()
    print(format_report(collect()))


def cli_main(argv: list[str] | None = None) -> int:
    """The ``ds_report`` console script."""
    parser = argparse.ArgumentParser(prog="ds_report", allow_abbrev=False)
    parser.add_argument(
        "--hide_operator_status", action="store_true", help="do not list the op builders"
    )
    parser.add_argument(
        "--hide_errors_and_warnings",
        action="store_true",
        help="do not say why an op cannot run here",
    )
    args = parser.parse_args(argv)
    main(args.hide_operator_status, args.hide_errors_and_warnings)
    return 0
