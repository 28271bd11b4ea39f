"""Deliberately broken engines (R23, R34): each mutant patches ONE engine instance through a named
seam — never a branch in the hot path, never a module-level change — to reproduce one realistic
bug. The mutation check runs the suites against each and demands that every mutant is caught and
that its first divergence is attributed (kvpage.verify.diff) to the class that matches its bug.
Mutants are grouped by the class of bug they plant, one module per class."""

from kvpage.verify.mutants.base import MissingSeam, Mutant
from kvpage.verify.mutants.cache import CACHE_MUTANTS, share_running_prefix

MUTANTS: tuple[Mutant, ...] = (*CACHE_MUTANTS,)

__all__ = ["MUTANTS", "MissingSeam", "Mutant", "share_running_prefix"]
