"""trainer/process/host_memory.py: the entry points re-exec themselves once under glibc malloc tunables
that reuse one heap in huge pages, which removes the per-step page faults of XLA:CPU's fresh
temporaries; and models/layers.Einsum's token-row contraction (one token dim, not two)."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from jax.extend.core import jaxprs_in_params

import sharding
from models.layers import Einsum
from sharding import MeshConfig
from sharding.rules import DEFAULT_RULES, layout_rules
from trainer.process import host_memory

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A step that allocates a fresh 64 MiB temporary on every call, then the page faults of 5 calls
# after a warm-up call, counted by the kernel (no timing).
_FAULTS = """
import resource, jax, jax.numpy as jnp
from trainer.process import host_memory
if {reexec}:
  host_memory.reexec_with_tunables()
step = jax.jit(lambda x: jnp.sum(jnp.sin(x)[::-1] * x))
x = jnp.ones((4096, 4096), jnp.float32)
step(x).block_until_ready()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
  step(x).block_until_ready()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", host_memory.OPT_OUT)}
  return dict(env, JAX_PLATFORMS="cpu", XLA_FLAGS="", **extra)


def _page_faults(reexec: bool) -> int:
  # `python -c` imports from its working directory: the repository's code.
  out = subprocess.run([sys.executable, "-c", _FAULTS.format(reexec=reexec)], cwd=ROOT,
                       env=_env(), capture_output=True, text=True, check=True, timeout=300)
  return int(out.stdout.strip().splitlines()[-1])


def test_tunables_remove_the_page_faults_of_fresh_temporaries():
  default, tuned = _page_faults(False), _page_faults(True)
  # 64 MiB of fresh temporaries per call is ~16k faults of 4 KiB pages per call.
  assert default > 5 * 8_000, default
  assert tuned < default / 20, (tuned, default)


def test_reexec_keeps_pid_and_arguments_and_respects_the_user():
  script = ("import os, sys; from trainer.process import host_memory; "
            "host_memory.reexec_with_tunables(); "
            "print(os.getpid(), os.environ.get('GLIBC_TUNABLES'), sys.argv[1:])")

  def run(**env):
    """(pid the child printed after the re-exec, the pid it was started with, tunables, argv)."""
    proc = subprocess.Popen([sys.executable, "-c", script, "a", "--b=1"], cwd=ROOT,
                            env=_env(**env), stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0
    pid, tunables, argv = out.split(" ", 2)
    return int(pid), proc.pid, tunables, argv

  pid, started_as, tunables, argv = run()
  assert pid == started_as  # execve: the same process, so launchers (srun, mpirun) keep track
  assert tunables == host_memory.TUNABLES and argv.strip() == "['a', '--b=1']"
  # A setting the user chose stays; the missing ones are added.
  _, _, tunables, _ = run(GLIBC_TUNABLES="glibc.malloc.arena_max=4")
  assert tunables.split(":")[0] == "glibc.malloc.arena_max=4"
  assert "glibc.malloc.arena_max=1" not in tunables and "glibc.malloc.hugetlb=1" in tunables
  _, _, tunables, _ = run(**{host_memory.OPT_OUT: "1"})
  assert tunables == "None"


def _contracting_dims(fn, *args):
  """Contracting-dim counts of every dot_general in fn's jaxpr (forward and backward)."""
  return sorted(len(e.params["dimension_numbers"][0][0])
                for e in _all_eqns(jax.make_jaxpr(fn)(*args)) if e.primitive.name == "dot_general")


def _all_eqns(closed):
  """The equations of a closed jaxpr and of every jaxpr nested in their params."""
  stack, out = [closed.jaxpr], []
  while stack:
    jaxpr = stack.pop()
    out.extend(jaxpr.eqns)
    stack.extend(sub for eqn in jaxpr.eqns for sub in jaxprs_in_params(eqn.params))
  return out


@pytest.mark.parametrize("options,split", [
    ({}, False), (dict(fsdp=4, tensor=2), False), (dict(fsdp=4, tensor=2, sp=True), True),
    (dict(fsdp=4, context=2), True)])
def test_token_rows_unless_a_mesh_axis_splits_the_sequence(options, split):
  sp = options.pop("sp", False)
  config = MeshConfig(**{"data": 1, **options})
  mesh = sharding.make_mesh(config, jax.devices()[:config.data * config.fsdp * config.tensor
                                                  * config.context])
  layout = sharding.Layout(**sharding.mesh_sizes(mesh), sequence_parallel=sp, mesh=mesh,
                           rules=layout_rules(DEFAULT_RULES, sequence_parallel=sp))
  assert layout.tokens_split == split
  graphdef, params = nnx.split(Einsum((16, 24), ("embed", "mlp"), (0,), param_dtype=jnp.float32,
                                       dtype=jnp.float32, rngs=nnx.Rngs(0),
                                       tokens_split=layout.tokens_split))
  x = jax.random.normal(jax.random.key(1), (4, 8, 16))

  def loss(params, x):
    return jnp.sum(jnp.sin(nnx.merge(graphdef, params)("BLD,DF->BLF", x)))

  def reference(w, x):
    return jnp.sum(jnp.sin(jnp.einsum("BLD,DF->BLF", x, w)))

  with layout.scope():
    grad_fn = jax.grad(loss, argnums=(0, 1))
    dims = _contracting_dims(grad_fn, params, x)
    grad_params, grad_x = grad_fn(params, x)
  # The forward and both gradients: with whole sequences per device every dot contracts one dim;
  # otherwise the weight gradient contracts the two token dims [B, L].
  assert dims == ([1, 1, 1] if not split else [1, 1, 2]), dims
  want = jax.grad(reference, argnums=(0, 1))(jax.tree.leaves(params)[0], x)
  for got, want in zip((jax.tree.leaves(grad_params)[0], grad_x), want):
    assert float(jnp.max(jnp.abs(got - want))) < 1e-5
  assert not sharding.Layout().tokens_split  # one device (no mesh): whole sequences
