"""A grouped matmul as batched GEMMs over equal slots per group ("capacity"), dropping nothing.

`capacity_matmul(x, w, group_sizes)` is `jax.lax.ragged_dot`: rows [M, K] sorted by group, the
first group_sizes[0] rows times w[0] [K, N], the next group_sizes[1] rows times w[1], ...; rows
past the groups give zeros. Each of the G groups gets C = ceil(M / G) slots. Round r gathers rows
[r·C, (r+1)·C) of every group into [G, C, K] (zeros past a group's end), multiplies them by w in
one batched GEMM (what XLA:GPU gives any batched dot: a cuBLAS or Triton GEMM, priced at the
dense GEMMs' rate, where the Pallas grouped kernel ran at about a quarter of it on the lent H200:
sharding/plan/profiles.py) and gathers the products back to the rows. Both moves are gathers
(a row's slot and a slot's row are computed, nothing is scattered).

One round holds every row when no group has more than C rows: M / G is the balanced share of
the buffer, which the dropless exchange already sizes with its headroom (sharding/expert.py).
The rounds after the first run in a while loop as many times as the largest group needs, so
nothing is dropped; the loop is named OVERFLOW_ROUNDS, which the compiled-program analysis counts
0 times (the predicted case, as for the exchange's own rounds: sharding/exchange_rounds.py).
The FLOPs are those of the padded buffer, G·C >= M rows, as the grouped kernel's are priced.
"""

import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from kernels.grouped_matmul import summed_like
from kernels.per_replica import per_replica
from kernels.residuals import keep

# The name scope of loops that run only rounds after the first, here and in the exchange's
# (sharding/exchange_rounds.py): the compiled-program analysis (sharding/xla/hlo.trip_count)
# counts them 0 times, the predicted case.
OVERFLOW_ROUNDS = "exchange_overflow_rounds"


def slots_per_group(rows: int, groups: int) -> int:
  """C: the slots each group gets in a round, the buffer's balanced share."""
  return -(-rows // groups)


def _starts(group_sizes):
  return jnp.cumsum(group_sizes) - group_sizes


def _gathered(x, group_sizes, capacity, r, order=None):
  """Round r's rows of each group: [G, C, K], zeros past each group's end; through `order` (sorted
  row i is x[order[i]]) when x's rows are not sorted by group."""
  at = r * capacity + jnp.arange(capacity, dtype=group_sizes.dtype)
  rows = _starts(group_sizes)[:, None] + at[None, :]
  if order is not None:
    rows = order[jnp.clip(rows, 0, x.shape[0] - 1)]
  rows = jnp.where(at[None, :] < group_sizes[:, None], rows, x.shape[0])  # past x: filled
  return x.at[rows].get(mode="fill", fill_value=0)


def _row_slots(group_sizes, rows: int, capacity: int):
  """Each row's group (G past the groups) and position in it: [M] each."""
  ends = jnp.cumsum(group_sizes)
  # A compare-and-count (as sharding/expert.py does): searchsorted mistypes under vmap there.
  group = jnp.sum(ends[None, :] <= jnp.arange(rows, dtype=ends.dtype)[:, None], axis=1)
  start = jnp.where(group < group_sizes.shape[0],
                    _starts(group_sizes)[jnp.minimum(group, group_sizes.shape[0] - 1)], rows)
  return group, jnp.arange(rows, dtype=ends.dtype) - start


def _back_to_rows(y_GCN, group, position, capacity, r, into):
  """Round r's products [G, C, N] at their rows [M, N]; the other rows from `into`."""
  g, c, n = y_GCN.shape
  here = (group < g) & (position >= r * capacity) & (position < (r + 1) * capacity)
  slot = jnp.clip(group * c + position - r * capacity, 0, g * c - 1)
  return jnp.where(here[:, None], y_GCN.reshape(g * c, n)[slot], into)


def _overflow(rounds_needed, body, init, *operands):
  """init after body(r, carry, *operands) for 1 <= r < rounds_needed, in a loop named
  OVERFLOW_ROUNDS; under gradient accumulation's replica vmap once per replica
  (kernels/per_replica.py: batched, the data=2 x fsdp candidates of DeepSeek-V3 failed to
  trace)."""
  def loop(rounds_needed, init, *operands):
    with jax.named_scope(OVERFLOW_ROUNDS):
      return jax.lax.while_loop(lambda c: c[0] < rounds_needed,
                                lambda c: (c[0] + 1, body(c[0], c[1], *operands)),
                                (jnp.ones_like(rounds_needed), init))[1]
  return per_replica(loop)(rounds_needed, init, *operands)


def rows_to_slots(x, group_sizes, capacity: int, r, order=None):
  """Round r's rows of each group of x [M, K] in `capacity` slots: [G, C, K], zeros past each
  group's end (models/slot_experts.py runs a whole SwiGLU on them). `order`: x's rows are not
  sorted by group, sorted row i is x[order[i]] (one gather through both)."""
  return _gathered(x, group_sizes, capacity, r, order)


def slots_to_rows(y_GCN, group_sizes, capacity: int, r, into, back=None):
  """Round r's products [G, C, N] at their rows of `into` [M, N], its other rows kept. `back`:
  the inverse of rows_to_slots' `order` (row j of `into` is sorted row back[j])."""
  group, position = _row_slots(group_sizes, into.shape[0], capacity)
  if back is not None:
    group, position = group[back], position[back]
  return _back_to_rows(y_GCN, group, position, capacity, r, into)


def overflow_rounds(group_sizes, capacity: int, body, init, *operands):
  """init after body(r, carry, *operands) for each round 1 <= r that a group's rows need, in a
  loop named OVERFLOW_ROUNDS (counted 0 times by the analysis); once per replica under vmap."""
  return _overflow(_rounds_needed(group_sizes, capacity), body, init, *operands)


def as_stored(w):
  """w, read as stored: left free, XLA:GPU lays the whole stack of a scanned model's weights out
  again (in the forward an f8 GEMM wants K minor) and keeps that copy beside the stored one
  (Qwen3-30B-A3B EP16: 3.4 GiB more at the peak); pinned, its Triton GEMM reads the f8 tiles
  transposed."""
  return with_layout_constraint(w, Layout(major_to_minor=tuple(range(w.ndim))))


def capacity_matmul(x, w, group_sizes, *, slots: int = 0, transposed: bool = False,
                    preferred_element_type=None, scale=None):
  """ragged_dot(x, w, group_sizes) by rounds of batched GEMMs; not differentiable (see
  `capacity_grouped`). x [M, K]; w [G, K, N] (`transposed`: [G, N, K], multiplied transposed);
  `slots` a group (0: ceil(M / G)); the products in `preferred_element_type` (x's dtype by
  default), divided by `scale` in it when given (fp8's per-tensor scales, the pattern XLA:GPU
  folds into the GEMM)."""
  m, g = x.shape[0], w.shape[0]
  dtype = preferred_element_type or x.dtype
  capacity = slots or slots_per_group(m, g)
  eqn = "gck,gnk->gcn" if transposed else "gck,gkn->gcn"
  group, position = _row_slots(group_sizes, m, capacity)

  w = as_stored(w)

  def run(r, into, x, w, group_sizes, group, position, scale):
    y = jnp.einsum(eqn, _gathered(x, group_sizes, capacity, r), w, preferred_element_type=dtype)
    y = y if scale is None else y / scale.astype(dtype)
    return _back_to_rows(y, group, position, capacity, r, into)
  operands = (x, w, group_sizes, group, position, scale)
  first = run(0, jnp.zeros((m, w.shape[1 if transposed else 2]), dtype), *operands)
  return _overflow(_rounds_needed(group_sizes, capacity), run, first, *operands)


def capacity_weight_grad(x, dy, group_sizes, *, slots: int = 0, preferred_element_type=None,
                         scale=None):
  """dW [G, K, N] = x_g^T dy_g per group from x [M, K] and dy [M, N], by the same rounds;
  divided by `scale` (per tensor) in the result dtype when given."""
  dtype = preferred_element_type or x.dtype
  capacity = slots or slots_per_group(x.shape[0], group_sizes.shape[0])

  def run(r, into, x, dy, group_sizes, scale):
    dw = jnp.einsum("gck,gcn->gkn", _gathered(x, group_sizes, capacity, r),
                    _gathered(dy, group_sizes, capacity, r), preferred_element_type=dtype)
    return into + (dw if scale is None else dw / scale.astype(dtype))
  operands = (x, dy, group_sizes, scale)
  first = run(0, jnp.zeros((group_sizes.shape[0], x.shape[1], dy.shape[1]), dtype), *operands)
  return _overflow(_rounds_needed(group_sizes, capacity), run, first, *operands)


def _rounds_needed(group_sizes, capacity):
  return (jnp.max(group_sizes) + capacity - 1) // capacity


def capacity_grouped(x, w, group_sizes, slots: int = 0):
  """`jax.lax.ragged_dot(x, w, group_sizes)` by capacity rounds of `slots` a group (0: the
  buffer's balanced share), differentiable in x and w (dx and dW by the same rounds). The
  products are named a kernel's output (kernels/residuals.py), which remat="none" keeps: a
  custom gradient's output is no dot to a remat policy, so a checkpointed layer ran the forward's
  batched GEMMs again in its backward, where the Pallas kernel's and the fp8 GEMMs' outputs
  were kept (tests/test_capacity_matmul.py counts them)."""
  return keep(_capacity_grouped(x, w, group_sizes, slots))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _capacity_grouped(x, w, group_sizes, slots: int = 0):
  return capacity_matmul(x, w, group_sizes, slots=slots)


def _forward(x, w, group_sizes, slots):
  return capacity_matmul(x, w, group_sizes, slots=slots), (x, w, group_sizes)


def _backward(slots, residuals, dy):
  x, w, group_sizes = residuals
  dx = capacity_matmul(dy, w, group_sizes, slots=slots, transposed=True,
                       preferred_element_type=x.dtype)
  dw = capacity_weight_grad(x, dy, group_sizes, slots=slots, preferred_element_type=w.dtype)
  return summed_like(dx, x), summed_like(dw, w), None


_capacity_grouped.defvjp(_forward, _backward)
