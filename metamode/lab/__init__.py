"""Lab code: the demo, the benchmark, the race scenarios and the tiny SDXL fixture.

Not part of metamode's API. Its modules run stock libraries in processes that
must not have metamode's registration hooks installed, so none of them imports
metamode's core at module level, and ``import metamode`` imports nothing eager
(see ``metamode/__init__.py``): a worker just runs ``python -m
metamode.lab.scenarios``. They import the core only inside the functions that
use metamode. :func:`core_imported` tells whether a process has it.
"""

from __future__ import annotations

import sys

__all__ = ["core_imported"]

# The module whose import installs the registration hooks (metamode._core.modes imports it).
_CORE = "metamode._core.hooks"


def core_imported() -> bool:
    """True once metamode's core, and with it the registration hooks, is imported."""
    return _CORE in sys.modules
