"""Weight merging with mergekit's methods and recipe format, and checkpoint averaging (LAWA);
the result is a trimtab run directory."""

from trimtab.merge.merge import average, merge
from trimtab.merge.recipe import METHODS, read_recipe

__all__ = ["METHODS", "average", "merge", "read_recipe"]
