"""A chunk's forward residuals kept for its backward tick, as Megatron's stages keep their
activations (Layout.pipeline_recompute=False): the forward tick takes the chunk's pullback
(jax.vjp) and stores its arrays, each microbatch in its slot; the backward tick rebuilds the
pullback from them instead of running the chunk's forward again. What the pullback holds is
what the chunk's remat policy keeps (models/transformer.py).

Of the pullback's arrays, those computed from the weights alone (each layer's slice of the
stacked weights, their casts, the fp8 copies) are the same for every microbatch: they are not
stored but computed again in the backward tick, from the one traced program of the forward (a
jaxpr), cut to what they need."""

import jax
import jax.numpy as jnp
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal, jaxpr_as_fun

from sharding.pipeline import stage_split


def _depends(jaxpr: Jaxpr, sources) -> set:
  """The variables of `jaxpr` computed from any of `sources` (an equation's outputs depend on
  all its inputs: nested programs are not looked into)."""
  found = set(sources)
  for eqn in jaxpr.eqns:
    if any(not isinstance(v, Literal) and v in found for v in eqn.invars):
      found.update(eqn.outvars)
  return found


def _cut(closed: ClosedJaxpr, outvars) -> ClosedJaxpr:
  """`closed` computing only `outvars`: the equations they need, the same inputs."""
  jaxpr, needed, eqns = closed.jaxpr, {v for v in outvars if not isinstance(v, Literal)}, []
  for eqn in reversed(jaxpr.eqns):
    if any(v in needed for v in eqn.outvars):
      eqns.append(eqn)
      needed.update(v for v in eqn.invars if not isinstance(v, Literal))
  effects = frozenset().union(*(eqn.effects for eqn in eqns))
  info = jaxpr.debug_info and jaxpr.debug_info.with_unknown_names()  # fewer results
  return ClosedJaxpr(jaxpr.replace(outvars=list(outvars), eqns=eqns[::-1], effects=effects,
                                   debug_info=info), closed.consts)


class KeptResiduals:
  """A chunk's forward, traced once: `forward` runs it in a forward tick and returns what to
  store, `pullback` rebuilds its pullback in a backward tick.

  fn(weights, x, mb) -> ((y, loss), aux): the chunk, differentiated w.r.t. weights[0] (its
  layers' weights) and x; `weights`' other entries and `mb` are not differentiated. `vary`
  types the inputs as a tick has them (varying over the manual axes), so that the one traced
  program runs in every tick."""

  def __init__(self, fn, weights, x, mb, vary):
    found, self.vary = [], vary
    weights, x, mb = vary((weights, x, mb))

    def traced(weights, x, mb):
      out, pullback, aux = jax.vjp(lambda p, x: fn((p, *weights[1:]), x, mb), weights[0], x,
                                   has_aux=True)
      leaves, treedef = jax.tree.flatten(pullback)
      found.append(treedef)
      return (out, aux), leaves
    self.program, (self.outputs, leaves) = jax.make_jaxpr(traced, return_shape=True)(
        weights, x, mb)
    self.treedef = found[0]
    jaxpr = self.program.jaxpr
    weight_count = len(jax.tree.leaves(weights))
    per_microbatch = _depends(jaxpr, jaxpr.invars[weight_count:])
    residual_vars = jaxpr.outvars[len(jax.tree.leaves(self.outputs)):]
    # Per residual: stored (computed from x or the microbatch) or computed from the weights.
    self.stored_here = [not isinstance(v, Literal) and v in per_microbatch
                        for v in residual_vars]
    self.stored = [s for s, kept in zip(leaves, self.stored_here) if kept]
    self._from_weights = _cut(self.program, [v for v, kept in zip(residual_vars,
                                                                  self.stored_here) if not kept])

  def forward(self, weights, x, mb):
    """((y, loss), aux, [arrays to store]) of the chunk on x."""
    values = jaxpr_as_fun(self.program)(*jax.tree.leaves(self.vary((weights, x, mb))))
    count = len(jax.tree.leaves(self.outputs))
    out, aux = jax.tree.unflatten(jax.tree.structure(self.outputs), values[:count])
    # Typed varying as the tick's buffers are (the MoE exchange's index arrays, computed from
    # constants alone, are not: the tick's switch refused them beside its idle zeros).
    stored = self.vary([v for v, kept in zip(values[count:], self.stored_here) if kept])
    return out, aux, stored

  def pullback(self, weights, x, mb, stored):
    """The pullback of the forward that stored `stored` (x and mb: any of their shape)."""
    rebuilt = iter(jaxpr_as_fun(self._from_weights)(*jax.tree.leaves(self.vary((weights, x,
                                                                                   mb)))))
    stored = iter(stored)
    return self.treedef.unflatten([next(stored) if kept else next(rebuilt)
                                   for kept in self.stored_here])


def for_stage(stage, patterns, vary, local, quantized, shared, x, mb) -> KeptResiduals:
  """A pipeline stage's chunk (StageFns.stage; `local`, `quantized`: the device's chunks' weights
  and fp8 copies, traced on the first) with kept residuals, called with (mb, the tick's row
  pattern number) for mb. Its rows: `patterns`' one, or where the positions' patterns nest
  (stage_split.nested: one stack split unevenly, as Llama-3.1-405B's 126 layers on 16 stages)
  the fullest one's at every position with the tick's padding rows masked, as the recomputing
  executor runs them: one traced program serves every chunk."""
  if len(patterns) > 1 and not stage_split.nested(patterns):
    raise ValueError("kept residuals need one row pattern or nested ones"
                     " (sharding/resolution.py refuses the rest)")

  def chunk(weights, x, inputs):
    mb, pattern = inputs
    rows = stage_split.masked_rows(patterns, pattern) if len(patterns) > 1 else patterns[0]
    y, loss, stats, row_stats = stage(weights[2], weights[0], x, mb, rows, weights[1])
    return (y, vary(loss)), (stats, row_stats)
  first = lambda tree: jax.tree.map(lambda w: w[0], tree)
  return KeptResiduals(chunk, (first(local), first(quantized), shared), x,
                       (mb, jnp.int32(0)), vary)
