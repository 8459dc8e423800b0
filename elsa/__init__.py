"""elsa: extended linear self-attention (ELSA), exact constructions and in-context learning.

Reference: Hagiwara, "An extension of linear self-attention for in-context
learning", arXiv:2503.23814 (2025).
"""

from elsa import constructions, decompile, forms, nn, ridge, tasks, training
from elsa.attention import (ElsaParams, PrunedStack, elsa, elsa_layer,
                            elsa_stack, lsa, prune)

__all__ = ["ElsaParams", "PrunedStack", "constructions", "decompile", "elsa", "elsa_layer",
           "elsa_stack", "forms", "lsa", "nn", "prune", "ridge", "tasks", "training"]
# The one place the version is written: setup.py reads it, CHANGELOG.md names it.
__version__ = "0.1.0"
