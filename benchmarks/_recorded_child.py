"""``python -m benchmarks._recorded_child (-m MODULE | -c CODE) ARGS``: run a Python child of a
benchmark as python would, its loaded files recorded at exit (``benchmarks._measured_code``,
imported through the ``benchmarks`` package). A module of its own, so that the one it runs as
``__main__`` is not also imported by the package (runpy warns of that).
"""

from __future__ import annotations

import runpy
import sys


def main(arguments: list[str]) -> None:
    """Run ``-m module args`` or ``-c code args`` as python would."""
    if len(arguments) < 2 or arguments[0] not in ("-m", "-c"):
        raise SystemExit(f"usage: python -m benchmarks._recorded_child (-m MODULE | -c CODE) ...; "
                         f"got {arguments}")  # fmt: skip
    flag, target, rest = arguments[0], arguments[1], arguments[2:]
    if flag == "-m":
        sys.argv = [target, *rest]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = ["-c", *rest]
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102


if __name__ == "__main__":
    main(sys.argv[1:])
