"""`python -m equinox_dsv4.compile`: compile full-size programs without weights, and say what
they need per device (see `python -m equinox_dsv4.compile --help`).

May import: everything in the package.
"""

from ._cli import main as main
from ._report import TPU_PEAKS as TPU_PEAKS


__all__ = ["main", "TPU_PEAKS"]
