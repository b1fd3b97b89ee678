"""What fp4compile warns about: a leaf module, so that every layer (the code generators too) can warn
without importing the backend."""

from __future__ import annotations


class PlanWarning(UserWarning):
    """The compiler cannot apply the recipe as asked to a part of the model (the message says which
    part and why); given once per backend, and listed in ``Backend.report.warnings``."""
