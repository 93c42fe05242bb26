"""The grouped matmul's backward reads the expert weights as they are stored: dx = dy @ w^T takes
each tile of w transposed inside the kernel (kernels/grouped_matmul.py, `transposed`), where a
transpose outside made XLA keep the layer scan's whole stack of expert weights transposed for the
later rounds' backward (3.4 GiB of the Qwen3-30B-A3B FP8 EP16 program, and a copy of it each
microbatch). The programs are the deviceless 8xH100 compiles of tests/test_exchange_chunks.py."""

import jax.numpy as jnp
import numpy as np

from benchmarks import gpu_predict
from kernels.grouped_matmul import grouped_matmul_fp8
from sharding.plan.profiles import profile_of_device
from sharding.xla import hlo, step_time
from tests.test_exchange_chunks import program, tiny_moe


def stacked_expert_weights() -> set:
  """Dims of one device's stacked expert weights in `program`'s model (layers, local experts,
  then D x F or F x D), as a sorted tuple, so a transposed copy of them matches too."""
  cfg = tiny_moe(1).model
  moe = cfg.moe
  layers, local = cfg.moe_layers(), moe.num_experts // 8
  return {tuple(sorted((layers, local, cfg.embed_dim, moe.mlp_dim(cfg.mlp_dim))))}


def transposes(text: str) -> list:
  """The output dims of every transpose: a transpose op, or a fusion whose body holds one."""
  comps = hlo.computations(text)
  transposing = {c for c, instrs in comps.items() if any(i.op == "transpose" for i in instrs)}
  return [tuple(sorted(s)) for instrs in comps.values() for i in instrs
          if i.op == "transpose" or (i.op == "fusion" and set(hlo.callees(i)) & transposing)
          for _, s in hlo.arrays(i.type)[:1]]


def visit_program(run: str) -> str:
  """A program the lent H200 ran (visit 2026-11-27c), compiled before the kernel took `transposed`."""
  return gpu_predict.run_program(gpu_predict.visit_artifacts("2026-11-27c"), run)


def test_the_stacked_expert_weights_are_never_transposed():
  """Before: the H200's program of 4 Qwen3-30B-A3B layers (128 experts of 2048 x 768 on one
  device) transposed its stacked expert weights; now the tiny MoE's transposes none of them."""
  before = transposes(visit_program("cudnn-selective-qwen3_30b_a3b-4-dropless"))
  assert tuple(sorted((4, 128, 2048, 768))) in before
  weights = stacked_expert_weights()
  assert not weights & set(transposes(program(1))), weights


def test_every_grouped_matmul_call_is_priced_at_its_flops():
  """Forward, dx (weights read transposed) and dW calls alike: a gemm of 2·M·K·N FLOPs, K and N
  the expert's dims (D and F, either way round), M the exchange buffer's rows."""
  text = program(1)
  cfg = tiny_moe(1).model
  d, f = cfg.embed_dim, cfg.moe.mlp_dim(cfg.mlp_dim)
  grouped = {name for name, path in hlo.op_names(text).items()
             if step_time.GROUPED_MATMUL.search(path)}
  calls = [o for o in step_time.predict(text, profile_of_device("NVIDIA H100 80GB HBM3"),
                                        top=10 ** 6).top_ops if o["name"] in grouped]
  assert len(calls) >= 6 and {o["kind"] for o in calls} == {"gemm"}
  # One buffer of rows through every call, D and F padded to the kernel's 128-multiples.
  padded = lambda v: -(-v // 128) * 128  # noqa: E731
  rows = {o["flops"] / (2 * padded(d) * padded(f)) for o in calls}
  assert len(rows) == 1 and all(r > 0 and r % 64 == 0 for r in rows), rows


def test_fp8_weights_read_transposed_equal_the_transposed_weights():
  """grouped_matmul_fp8's `transposed` operand, w as [G, N, K], against swapaxes(w) as [G, K, N]
  (the bf16 kernel's dx, the same path, is tests/test_grouped_matmul.py's gradient check)."""
  rng = np.random.default_rng(0)
  sizes = jnp.array([5, 0, 11], jnp.int32)
  qx = jnp.asarray(rng.normal(size=(16, 64)), jnp.float32).astype(jnp.float8_e4m3fn)
  qw = jnp.asarray(rng.normal(size=(3, 128, 64)), jnp.float32).astype(jnp.float8_e4m3fn)
  x_scale, w_scale = jnp.full((16,), 2.0), jnp.full((3, 128), 0.5)
  got = grouped_matmul_fp8(qx, qw, sizes, x_scale, w_scale, out_dtype=jnp.float32,
                           interpret=True, transposed=True)
  want = grouped_matmul_fp8(qx, jnp.swapaxes(qw, 1, 2), sizes, x_scale, w_scale,
                            out_dtype=jnp.float32, interpret=True)
  assert got.shape == (16, 128) and float(jnp.max(jnp.abs(want[:16]))) > 0
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
