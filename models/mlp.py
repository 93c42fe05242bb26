"""SwiGLU feed-forward: gate and up column-split over `mlp`, down row-split."""

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import RESIDUAL, Einsum, project_shared, projection_kw
from sharding import logical_all_gather_matmul, logical_matmul_reduce_scatter

HIDDEN = ("batch", "seq", "act_mlp")


class MLP(nnx.Module):
  """down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, compute, layout, *, rngs: nnx.Rngs):
    d, f = cfg.embed_dim, cfg.mlp_dim
    kw = projection_kw(cfg, compute, layout, rngs, "mlp")
    self.gate = Einsum((d, f), ("embed", "mlp"), (0,), **kw)
    self.up = Einsum((d, f), ("embed", "mlp"), (0,), **kw)
    self.down = Einsum((f, d), ("mlp", "embed"), (0,), **kw)
    self.collective_matmul = compute.collective_matmul
    self.remat = compute.remat  # whether the input is gathered once (models/layers.py)
    self.layout = layout  # the collective matmuls' mesh
    self.dtype = cfg.dtype

  def __call__(self, x_BLD: jax.Array, input_amax=None) -> jax.Array:
    """`input_amax`: as models/layers.py Einsum's (the collective matmuls run in bf16)."""
    if self.collective_matmul:
      return self._collective(x_BLD)
    # One gather for gate and up (models/layers.py): in fp8 when tensorwise, else in bf16 for
    # layers that recompute.
    gate, up = project_shared(self.layout, (self.gate, self.up), ("BLD,DF->BLF", "BLD,DF->BLF"),
                              (HIDDEN, HIDDEN), x_BLD, self.remat != "none", input_amax)
    hidden = jax.nn.silu(gate) * up
    # Its gradient gathered once for both of down's backward dots (Einsum's gather_gradient).
    return self.down("BLF,FD->BLD", hidden, gather_gradient=True)

  def _collective(self, x_BLD: jax.Array) -> jax.Array:
    """The same MLP with the sequence-parallel all-gather and reduce-scatter decomposed into
    ppermute steps under shard_map. Gate and up are stacked into one [D, 2, F] weight so the
    activations travel once."""
    x = x_BLD.astype(self.dtype)
    w_in = jnp.stack([self.gate.w[...], self.up.w[...]], axis=1).astype(self.dtype)
    gate_up = logical_all_gather_matmul(self.layout, x, w_in, RESIDUAL,
                                        ("batch", "seq", None, "act_mlp"))
    hidden = jax.nn.silu(gate_up[:, :, 0]) * gate_up[:, :, 1]
    return logical_matmul_reduce_scatter(self.layout, hidden,
                                         self.down.w[...].astype(self.dtype), HIDDEN, RESIDUAL)
