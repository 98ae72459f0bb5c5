"""Plots are optional: matplotlib comes with the ``bench`` extra, which ``.ci/setup.sh``
installs but an environment set up some other way may lack.

Every benchmark writes its tables and results files first and draws afterwards through
:func:`draw_or_explain`, so that a missing matplotlib costs the pictures and nothing
else: one line on stderr says so and how to install it, where a traceback would have
followed a run of many minutes. Standard library only, like `benchmarks.common`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

INSTALL_HINT = ".venv/bin/pip install -e '.[bench]'"

T = TypeVar("T")


def draw_or_explain(draw: Callable[[], T], written: str) -> T | None:
    """``draw()``'s result, or None when matplotlib cannot be imported: then one line
    says that there is no plot, why, how to get it, and what was written (``written``)."""
    try:
        return draw()
    except ModuleNotFoundError as err:
        # Only matplotlib itself is optional; any other missing module is a real fault.
        if (err.name or "").partition(".")[0] != "matplotlib":
            raise
    print(
        f"no plot: matplotlib is not installed (`{INSTALL_HINT}` adds it); {written}",
        file=sys.stderr,
        flush=True,
    )
    return None
