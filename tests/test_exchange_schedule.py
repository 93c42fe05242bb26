"""What XLA's GPU scheduler does with the dropless MoE's token exchange (jaxlib 0.10.2, compiled
for 16 H100s without a GPU): it moves a plain all-to-all's start and done apart to run
independent GEMMs between them, and a ragged all-to-all's (the exchange of
sharding/exchange_rounds.py) not: its latency-hiding scheduler does not count ragged all-to-all
among the async collectives it schedules (newer XLA's AsyncTracker lists it). Only what the
program's order already puts between them runs behind a ragged exchange (another chunk's expert
matmuls: tests/test_exchange_chunks.py), so the MoE anchor rows pay most of their exchange
exposed: Qwen3-30B-A3B EP16, 14.7 of its 43.4 s (docs/planning.md). A canary: when a jax
upgrade makes the second assertion fail, the MoE rows' programs are worth compiling again."""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding.xla import compiled

N, ROWS, D = 16, 4096, 1024


def schedule(kind: str) -> list[str]:
  """The entry computation's instructions in schedule order: an exchange of [ROWS, D] rows over
  16 devices beside two GEMMs that do not depend on it."""
  devices = compiled.gpu_devices(compiled.parse_gpu_target("h100x16"))
  mesh = Mesh(np.array(devices), ("x",))

  def body(x, w, y):
    if kind == "ragged":
      sizes = jnp.full((N,), ROWS // N, jnp.int32)
      offsets = jnp.arange(N, dtype=jnp.int32) * (ROWS // N)
      out = jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), offsets, sizes, offsets, sizes,
                                      axis_name="x")
    else:
      out = jax.lax.all_to_all(x.reshape(N, ROWS // N, D), "x", 0, 0).reshape(ROWS, D)
    return out * 2, jnp.tanh(y @ w) @ w.T

  step = jax.shard_map(body, mesh=mesh, in_specs=(P("x"), P(), P("x")),
                       out_specs=(P("x"), P("x")))
  split, whole = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
  args = (jax.ShapeDtypeStruct((N * ROWS, D), jnp.bfloat16, sharding=split),
          jax.ShapeDtypeStruct((D, 4096), jnp.bfloat16, sharding=whole),
          jax.ShapeDtypeStruct((N * 4096, D), jnp.bfloat16, sharding=split))
  text = jax.jit(step).lower(*args).compile().as_text()
  entry = text[text.index("ENTRY"):].split("\n}")[0]
  return re.findall(r"^\s*(?:ROOT )?%(\S+) = ", entry, re.M)


def between(order: list[str], start: str, done: str) -> list[str]:
  first = next(i for i, name in enumerate(order) if name.startswith(start))
  last = next(i for i, name in enumerate(order) if name.startswith(done))
  return [name for name in order[first + 1:last] if "gemm" in name or "dot" in name]


def test_xla_hides_an_all_to_all_behind_gemms_but_not_a_ragged_one():
  assert between(schedule("plain"), "all-to-all-start", "all-to-all-done")
  assert not between(schedule("ragged"), "ragged-all-to-all-start", "ragged-all-to-all-done")
