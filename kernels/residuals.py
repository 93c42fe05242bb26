"""The residuals a kernel's custom backward declares, named so that remat="none" keeps them
(models/compute.py saves named values) instead of recomputing the forward that made them."""

import jax
from jax.ad_checkpoint import checkpoint_name

NAME = "kernel_residual"


def keep(tree):
  """`tree` unchanged, each array named NAME (an identity for the forward and the gradient)."""
  return jax.tree.map(lambda x: checkpoint_name(x, NAME), tree)
