"""Prints the scheduled HLO of one sequence-parallel MLP block compiled for a GPU cluster without a
GPU (the gpu-aot extra): with the collective matmuls of sharding/collective_matmul.py, or the
plain matmuls whose all-gather and reduce-scatter XLA inserts (the baseline). Read by
benchmarks/overlap.py and tests/test_collective_matmul.py.

  JAX_PLATFORMS=cpu python -m benchmarks.sp_mlp_block TARGET TENSOR [grad] [plain]
      [dims=B,L,D,F] > block.hlo
"""

import sys

import jax
import jax.numpy as jnp

from sharding import (DEFAULT_RULES, Layout, MeshConfig, constrain, layout_rules,
                      logical_all_gather_matmul, logical_matmul_reduce_scatter, make_mesh,
                      mesh_sizes, named_sharding)
from sharding.xla import compiled, presets

RESIDUAL, HIDDEN = ("batch", "res_seq", "act_embed"), ("batch", "seq", "act_mlp")


def sp_mlp(layout, x, w_in, w_out, collective: bool = True):
  """A sequence-parallel two-matmul block (the shape of a Megatron SP MLP) under `layout` (a
  sharding.Layout with its mesh, in its scope): x [B, L, D] ("batch", "res_seq", "act_embed")
  -> same names. `collective`: with the two collective matmuls; else the plain matmuls with
  sharding constraints (XLA's all-gather and reduce-scatter), the baseline."""
  if collective:
    hidden = logical_all_gather_matmul(layout, x, w_in, RESIDUAL, HIDDEN)
    return logical_matmul_reduce_scatter(layout, jax.nn.silu(hidden), w_out, HIDDEN, RESIDUAL)
  hidden = constrain(jnp.tensordot(x, w_in, axes=1), HIDDEN)
  return constrain(jnp.tensordot(jax.nn.silu(hidden), w_out, axes=1), RESIDUAL)


def compile_for_gpus(target_name: str, tensor: int, grad: bool, collective: bool,
                     dims: tuple[int, int, int, int]) -> str:
  """The scheduled HLO of `sp_mlp` (or its gradient) for x [B, L, D], w_in [D, F] on a
  deviceless GPU target with the default preset's options."""
  target = compiled.parse_gpu_target(target_name)
  mesh = make_mesh(MeshConfig(data=-1, tensor=tensor), compiled.gpu_devices(target))
  layout = Layout(**mesh_sizes(mesh), sequence_parallel=True, mesh=mesh, platform="gpu",
                  rules=layout_rules(DEFAULT_RULES, sequence_parallel=True))
  b, l, d, f = dims
  shapes = {"x": ((b, l, d), RESIDUAL), "w_in": ((d, f), ("embed", "mlp")),
            "w_out": ((f, d), ("mlp", "embed"))}
  with layout.scope():
    args = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=named_sharding(names, shape))
            for shape, names in shapes.values()]
    fn = lambda *a: sp_mlp(layout, *a, collective=collective)  # noqa: E731
    if grad:
      fn = jax.grad(lambda *a: jnp.sum(sp_mlp(layout, *a, collective=collective)
                                       .astype(jnp.float32) ** 2), argnums=(0, 1, 2))
    lowered = jax.jit(fn).lower(*args)
  options = presets.compiler_options(presets.DEFAULT_PRESET, mesh_sizes=dict(mesh.shape))
  return lowered.compile(compiler_options=options).as_text()


if __name__ == "__main__":
  flags = sys.argv[3:]
  sizes = [a[len("dims="):] for a in flags if a.startswith("dims=")]
  print(compile_for_gpus(sys.argv[1], int(sys.argv[2]), "grad" in flags, "plain" not in flags,
                         tuple(int(v) for v in (sizes or ["2,1024,512,2048"])[0].split(","))))
