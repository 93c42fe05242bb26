"""A layer scan whose backward adds each layer's weight gradient into the gradient-accumulation
buffer in place, layer by layer.

With plain autodiff, each microbatch's backward writes every layer's weight gradient into a new
stacked [layers, ...] buffer (the transposed scan's outputs), and only then is that buffer added
to the accumulation buffer: a second whole gradient beside the accumulator at the peak, and the
accumulator read and written once more per microbatch. Megatron's gradient-accumulation fusion
instead has each weight-gradient GEMM add into the accumulator. Here the accumulator is an input
of the scan, differentiated like the weights: the custom backward carries it through the
reversed loop and updates slice l with layer l's gradient, and the "cotangent" it returns for it
is accumulator + this microbatch's gradient. The train step (trainer/step.py) takes that as the
new accumulator; the weights' own cotangent is zero and unused.
"""

import functools

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap


def accumulating_scan(body, x, xs, acc, use_max):
  """lax.scan(body, x, xs) -> (x, ys). `acc`: xs's structure with, at the leaves to accumulate,
  a buffer of their stacked shape (float32, or an fp8 history's dtype), and None elsewhere;
  `use_max`: bools aligned with acc (True: combine by max, for fp8 amax histories). The
  cotangent of acc is acc combined with the gradient of those leaves of xs (see the module)."""
  return _scan(body, use_max, x, xs, acc)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scan(body, use_max, x, xs, acc):
  del use_max, acc
  return jax.lax.scan(body, x, xs)


def _is_none(a):
  return a is None


def _fwd(body, use_max, x, xs, acc):
  del use_max

  def step(h, xs_i):
    (h, y), pullback = jax.vjp(body, h, xs_i)
    return h, (y, pullback)  # the pullback is a pytree of this step's residuals: stacked
  h, (ys, pullbacks) = jax.lax.scan(step, x, xs)
  return (h, ys), (pullbacks, acc, xs)


def _bwd(body, use_max, res, cts):
  del body
  pullbacks, acc, xs = res
  ct_h, ct_ys = cts
  steps = jax.tree.leaves(xs)[0].shape[0]

  def step(carry, inputs):
    ct_h, acc = carry
    i, pullback, ct_y = inputs
    ct_h, ct_xs = pullback((ct_h, ct_y))

    def add(a, ct, m):
      return None if a is None else _COMBINE_ROW[bool(m)](a, i, ct.astype(a.dtype))
    acc = jax.tree.map(add, acc, ct_xs, use_max, is_leaf=_is_none)
    # The leaves not accumulated keep their per-step cotangents, stacked as usual (integer
    # leaves, like the padded stacks' row masks, have none).
    rest = jax.tree.map(lambda a, ct: ct if a is None and ct is not None
                        and ct.dtype != jax.dtypes.float0 else None, acc, ct_xs, is_leaf=_is_none)
    return (ct_h, acc), rest

  (ct_x, acc), ct_rest = jax.lax.scan(
      step, (ct_h, acc), (jnp.arange(steps), pullbacks, ct_ys), reverse=True)
  # None: a zero cotangent, for the accumulated weights (theirs is in the accumulator) too.
  return ct_x, ct_rest, acc


_scan.defvjp(_fwd, _bwd)


# Row i of a stacked buffer combined with a new row, read and written in place. The row is
# sliced and written with its dim kept (size 1): squeezed and expanded around the sum, XLA's GPU
# fusion kept the slices of a layer's weights apart, one multi-output fusion that read every
# weight's row into a temporary, then a second read of each in its in-place update (the NeMo
# 8B CP2 program's memory-bound kernels: 4.98 s a step that way, 4.13 s this way). Under the
# replicas' vmap (trainer/step.py) JAX batches dynamic_update_slice as a scatter, which XLA
# lowers with a bounds check: a select that reads the old row again. The rule indexes past the
# batch dim instead.


def _combining_row(combine):
  def plain(a, i, row, axis=0):
    old = jax.lax.dynamic_slice_in_dim(a, i, 1, axis)
    return jax.lax.dynamic_update_slice_in_dim(a, combine(old, jnp.expand_dims(row, axis)), i,
                                               axis)

  @custom_vmap
  def combined(a, i, row):
    return plain(a, i, row)

  @combined.def_vmap
  def rule(axis_size, in_batched, a, i, row):
    if in_batched[1] or not in_batched[0]:
      a, row = (x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
                for x, b in ((a, in_batched[0]), (row, in_batched[2])))
      return jax.vmap(plain, in_axes=(0, 0 if in_batched[1] else None, 0))(a, i, row), True
    if not in_batched[2]:
      row = jnp.broadcast_to(row, (axis_size, *row.shape))
    return plain(a, i, row, axis=1), True

  return combined


_COMBINE_ROW = {False: _combining_row(jnp.add), True: _combining_row(jnp.maximum)}


def aligned(like, acc, use_max):
  """(acc, use_max) laid out like the pytree `like` (a stack's pure-dict state): each leaf of
  `like` gets the leaf at the same dict path of `acc` and `use_max`, or None where they have none
  (variables that are not trained parameters)."""
  def find(tree, path):
    for key in path:
      key = getattr(key, "key", key)
      if not isinstance(tree, dict) or key not in tree:
        return None
      tree = tree[key]
    return tree
  paths, treedef = jax.tree_util.tree_flatten_with_path(like)
  return tuple(treedef.unflatten([find(tree, p) for p, _ in paths]) for tree in (acc, use_max))
