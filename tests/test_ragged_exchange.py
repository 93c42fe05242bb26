"""sharding/exchange_rounds.py's `ragged_exchange`: ragged_all_to_all with a transpose of its own,
whose zero buffers XLA cannot merge. XLA:CPU cannot run ragged_all_to_all, so its gradient is
checked against autodiff of an emulation in collectives the CPU runs (the primitive's
semantics, written out), and its program on the deviceless 8xH100 compile."""

import dataclasses
import functools
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding import exchange_rounds
from sharding.xla import compiled, hlo
from tests.test_exchange_chunks import tiny_moe
from trainer.aot import compile_for_gpus

N, ROWS, DIM = 4, 12, 3  # devices, rows of each operand and output buffer, row width


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                               recv_sizes, *, axis_name):
  """ragged_all_to_all's semantics by all_gather: sender i's rows input_offsets[j] ..
  + send_sizes[j] of its operand land in device j's output at output_offsets[j] (the offsets in
  the receiver's buffer); the output's other rows are kept. Differentiable by autodiff."""
  del recv_sizes  # the receiver's view of the same sizes
  me = jax.lax.axis_index(axis_name)
  gathered = [jax.lax.all_gather(a, axis_name) for a in (operand, input_offsets, send_sizes,
                                                         output_offsets)]
  rows = jnp.arange(output.shape[0])
  for i in range(gathered[0].shape[0]):
    x, start, size, at = (a[i] for a in gathered)
    k = rows - at[me]
    here = (k >= 0) & (k < size[me])
    output = jnp.where(here[:, None], x[jnp.clip(start[me] + k, 0, x.shape[0] - 1)], output)
  return output


def sizes_and_offsets(seed: int, packed: bool):
  """[N, N] send sizes (zeros among them), each sender's rows contiguous from 0, and where they
  land: each sender's own slot of the receiver (`packed=False`, the ragged round's way there)
  or the senders' rows back to back (`packed=True`, its way back: a sender of no rows lands
  where the next one starts)."""
  rng = np.random.default_rng(seed)
  send = rng.integers(0, 4, (N, N)) * (rng.random((N, N)) > 0.3)
  input_offsets = np.cumsum(send, axis=1) - send
  if packed:
    output_offsets = (np.cumsum(send, axis=0) - send)  # [i, j]: j's rows from senders < i
  else:
    output_offsets = np.tile(np.arange(N)[:, None] * (ROWS // N), (1, N))
  recv = send.T  # recv[j, i]: rows j receives from i
  return [jnp.asarray(a, jnp.int32) for a in (input_offsets, send, output_offsets, recv)]


@pytest.mark.parametrize("packed", [False, True])
def test_the_exchanges_gradient_is_the_transpose_of_the_exchange(monkeypatch, packed):
  """The vjp of `ragged_exchange` (its own backward) equals autodiff's of the emulated primitive,
  for the operand and for the output buffer's rows the exchange leaves."""
  monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
  mesh = Mesh(np.array(jax.devices()[:N]), ("e",))
  keys = jax.random.split(jax.random.key(0), 3)
  operand, output, cotangent = (jax.random.normal(k, (N, ROWS, DIM)) for k in keys)
  offsets = sizes_and_offsets(int(packed), packed)
  assert int(jnp.sum(offsets[1] == 0)) > 0  # some pairs send nothing

  def vjp_of(exchange):
    def per_device(x, out, ct, *offsets):
      y, pullback = jax.vjp(lambda x, out: exchange(x[0], out[0], *(o[0] for o in offsets)),
                            x, out)
      return (y[None], *pullback(ct[0]))
    spec = P("e")
    f = jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec)
    args = [jax.device_put(a, NamedSharding(mesh, spec)) for a in (operand, output, cotangent,
                                                                     *offsets)]
    return jax.jit(f)(*args)

  ours = vjp_of(lambda *a: exchange_rounds.ragged_exchange(*a, "e"))
  reference = vjp_of(functools.partial(emulated_ragged_all_to_all, axis_name="e"))
  received = np.abs(np.asarray(reference[0] - output)).sum(axis=-1) > 0
  assert received.any() and not received.all()  # some rows written, some kept
  for got, want in zip(ours, reference):
    np.testing.assert_array_equal(got, want)


@functools.lru_cache(maxsize=None)
def balanced_program() -> str:
  """The tiny MoE in 2 chunks with buffers of exactly a pair's balanced share
  (exchange_capacity=1, as the force-balanced Qwen3 row): all of a layer's 8 first-round
  exchange buffers, forward and backward, of one shape."""
  cfg = tiny_moe(2)
  cfg.model.moe = dataclasses.replace(cfg.model.moe, exchange_capacity=1.0)
  with tempfile.TemporaryDirectory() as tmp:
    path = f"{tmp}/step.hlo"
    compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), hlo_path=path)
    with open(path) as f:
      return f.read()


def test_no_exchange_buffer_is_a_copy_of_another():
  """Each ragged all-to-all writes a buffer of zeros of its own. JAX's transpose took a constant
  of zeros, which XLA merged across the backward's exchanges of one shape and then copied for
  all but one of them (3 copies a layer), and the forward's returns shared one too."""
  comps = hlo.computations(balanced_program())
  by_name = {i.name: i for instrs in comps.values() for i in instrs}
  starts = [i for i in by_name.values() if i.op == "ragged-all-to-all-start"]
  assert len(starts) >= 8
  buffers = [by_name.get(hlo.operands(i)[1]) for i in starts]
  copied = [b.name for b in buffers if b is not None and b.op == "copy"]
  assert not copied, copied
