"""compute.scan_layers=False: each layer's weights are arrays of their own and the layers run
unrolled (models/transformer.py `_per_layer`). It trains as the scanned model does (the train
step's comparison: tests/test_accumulating_scan.py), reads and writes Hugging Face weights and
its own checkpoints, refuses pipeline stages and a checkpoint of the other form in one line, and
its compiled program has none of the scan's per-microbatch copies of weight rows and stacked
residuals."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.extend.core import jaxprs_in_params

from configs import llama
from models import ComputeConfig, abstract_model, hf
from models.compute import PROJECTION, REMAT_POLICIES
from models.builder import is_per_layer, stacked
from models.layers import summed_einsum
from sharding import Layout, MeshConfig
from sharding.xla import compiled, hlo
from tests.test_checkpoint import rows, tiny_run
from tests import parallel_harness as harness
from tests.test_hf import TOKENS, assert_same_tensors, hf_llama, hf_logits, hf_mixtral
from tests.test_parallel import assert_same_training
from trainer import checkpoint, loop
from trainer.config import CheckpointConfig
from trainer.aot import compile_for_gpus

APART = ComputeConfig(scan_layers=False)
EVERY_2 = CheckpointConfig(every_steps=2)


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_hugging_face_weights_load_and_save_per_layer(tmp_path, family):
  """Imported apart: each layer its own arrays, the stacked import's values bitwise, its logits
  (the unrolled program rounds differently) and transformers'; exported: the same tensors,
  bitwise."""
  reference = (hf_llama if family == "llama" else hf_mixtral)(tmp_path / "hf")
  cfg = hf.read_config(str(tmp_path / "hf"))
  params = hf.load_params(str(tmp_path / "hf"), cfg, compute=APART)
  name = "layers" if family == "llama" else "moe_layers"
  assert is_per_layer(params[name]) and sorted(params[name]) == list(range(cfg.num_layers))
  model = nnx.merge(abstract_model(cfg, APART)[0], params)
  whole = hf.from_pretrained(str(tmp_path / "hf"))
  np.testing.assert_allclose(np.asarray(model(TOKENS)), np.asarray(whole(TOKENS)), atol=1e-5)
  assert np.abs(np.asarray(model(TOKENS)) - hf_logits(reference)).max() < 1e-4
  for got, want in zip(jax.tree.leaves(stacked(params)),
                       jax.tree.leaves(nnx.to_pure_dict(nnx.state(whole, nnx.Param)))):
    np.testing.assert_array_equal(got, want)
  hf.save_params(params, cfg, str(tmp_path / "out"))
  assert_same_tensors(tmp_path / "hf", tmp_path / "out")


def _apart(cfg):
  cfg.compute = dataclasses.replace(cfg.compute, scan_layers=False)
  return cfg


def test_checkpoints_resume_and_the_other_form_is_refused(tmp_path):
  """fsdp=4 x tensor=2: the run apart has the scanned run's losses; resumed from its step-2
  checkpoint it repeats steps 3 and 4 bitwise; a scanned run refuses that checkpoint in one
  line that names the setting, before touching anything."""
  loop.run(_apart(tiny_run(steps=4, checkpoint=EVERY_2)), str(tmp_path / "apart"))
  loop.run(tiny_run(steps=4, checkpoint=EVERY_2), str(tmp_path / "scanned"))
  apart, scanned = rows(tmp_path / "apart"), rows(tmp_path / "scanned")
  np.testing.assert_allclose([apart[s]["loss"] for s in range(1, 5)],
                             [scanned[s]["loss"] for s in range(1, 5)], rtol=1e-5)
  resumed = _apart(tiny_run(steps=4, checkpoint=EVERY_2))
  resumed.checkpoint.restore_from = str(tmp_path / "apart" / "checkpoints" / "2")
  loop.run(resumed, str(tmp_path / "resumed"))
  for step in (3, 4):
    assert rows(tmp_path / "resumed")[step]["loss"] == apart[step]["loss"]
  other = tiny_run(steps=4)
  other.checkpoint.restore_from = str(tmp_path / "apart" / "checkpoints" / "2")
  with pytest.raises(checkpoint.CheckpointError, match=(
      r"stores its layers each apart \(compute.scan_layers=false\), this run stacked: resume"
      r" with --config.compute.scan_layers=false")) as error:
    loop.run(other, str(tmp_path / "other"))
  assert "\n" not in str(error.value) and not (tmp_path / "other" / "checkpoints").exists()


def test_pipeline_stages_are_refused():
  cfg = _apart(tiny_run())
  cfg.mesh = MeshConfig(data=1, pipeline=2)
  with pytest.raises(ValueError, match="compute.scan_layers=false stores each layer apart, but"
                     " pipeline stages split a stack of layers: set compute.scan_layers=true"):
    cfg.validate()


def _row_copies(text: str, layers: int) -> list[str]:
  """The dynamic slices of a [layers, ...] buffer and the dynamic updates of one: a scan's
  reads of a layer's weight rows and its writes of kept activations into stacked residuals."""
  comps = hlo.computations(text)
  types = {i.name: i.type for instrs in comps.values() for i in instrs}
  stacked_type = re.compile(rf"^\w+\[{layers},")
  found = []
  for instrs in comps.values():
    for i in instrs:
      if i.op == "dynamic-update-slice" and stacked_type.match(i.type):
        found.append(f"{i.name}: {i.type}")
      elif i.op == "dynamic-slice" and stacked_type.match(types.get(hlo.operands(i)[0], "")):
        found.append(f"{i.name}: of {types[hlo.operands(i)[0]]}")
  return found


def test_the_h100_program_reads_weights_in_place(tmp_path):
  """3 layers, 2 microbatches, fsdp=8 on 8 H100s (deviceless): the scanned step copies weight
  rows out of [3, ...] stacks and writes residuals into them; the step with the layers apart
  has no dynamic slice or update of a [3, ...] buffer."""
  found = {}
  for scan in (True, False):
    cfg = llama.debug()
    cfg.mesh = MeshConfig(data=1, fsdp=8)
    cfg.model.num_layers, cfg.batch_size, cfg.seq_len, cfg.microbatches = 3, 16, 64, 2
    cfg.compute = dataclasses.replace(cfg.compute, scan_layers=scan)
    path = tmp_path / f"scan_{scan}.hlo"
    compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), hlo_path=str(path))
    found[scan] = _row_copies(path.read_text(), 3)
  assert found[True]  # the variants differ
  assert not found[False], found[False]


@pytest.mark.parametrize("tied", [False, True])
def test_the_train_step_sums_gradients_in_float32_as_plain_autodiff(tied):
  """Layers apart with whole gradient sums on each device (data=2 x context=2 x tensor=2,
  ZeRO-1, 2 microbatches): the projections' weight gradients leave their GEMMs in float32 into
  the running sums (models/layers.summed_einsum), the embedding's rows are scattered into its
  sum (summed_lookup; tied, the head's gradient joins it by plain autodiff); the step trains as
  the scanned one does. With fsdp the sums are split, and each microbatch's gradient is
  reduced first."""
  mesh = MeshConfig(data=2, context=2, tensor=2, zero_stage=1)
  assert Layout(data=2, context=2, tensor=2, zero_stage=1,
                microbatches=2).keeps_whole_gradient_sums  # the summed path runs
  assert not Layout(data=2, fsdp=2, tensor=2, microbatches=2).keeps_whole_gradient_sums
  model = dataclasses.replace(harness.MODEL, tie_embeddings=tied)
  runs = [harness.run(mesh, microbatches=2, model=model,
                      compute=dataclasses.replace(harness.COMPUTE, scan_layers=scan))
          for scan in (True, False)]
  assert_same_training(*runs)


def _gradient_gemms(text: str, shapes: set, table: tuple) -> dict:
  """The MLP weights' gradient GEMM fusions ([D, F] and [F, D] outputs), by output dtype, and
  the fusions that add a GEMM's output to a float32 sum of that shape; the fusions writing a
  float32 [V, D] (the embedding table's sum), by name ("scatter", "add", ...)."""
  found = {"bf16": 0, "f32": 0, "adds": 0, "table": []}
  for instrs in hlo.computations(text).values():
    kinds = {i.name: i for i in instrs}
    for i in instrs:
      dtype, _, dims = i.type.partition("[")
      dims = tuple(int(d) for d in dims.split("]")[0].split(",") if d)
      if i.op == "fusion" and dtype == "f32" and dims[-2:] == table:
        found["table"].append(re.sub(r"^(loop|input)_|_fusion[.\d]*$", "", i.name))
      if i.op != "fusion" or dims[-2:] not in shapes:
        continue
      if "kind=kCustom" in i.attrs and i.name.startswith("gemm_fusion"):
        found[dtype] = found.get(dtype, 0) + 1
      elif dtype == "f32" and any(o in kinds and kinds[o].name.startswith("gemm_fusion")
                                  for o in hlo.operands(i)):
        found["adds"] += 1
  return found


def test_the_h100_program_adds_each_weight_gradient_in_its_gemm(tmp_path):
  """2 layers apart, 2 microbatches, data=8 on 8 H100s (deviceless): the MLP weights' 6 gradient
  GEMMs write float32 and take the running sum as an operand, no add kernel of their own (no
  float32 gradient written, read again and added per microbatch), and the embedding's rows are
  scattered into its float32 sum. Under ZeRO-2 (sums split over `data`) the GEMMs write bf16,
  to be reduce-scattered first. Wide enough (D 2048, F 8192) that XLA does not merge the gate
  and up GEMMs, which share their input, into one."""
  found = {}
  for zero in (1, 2):
    cfg = llama.large("llama3_8b")  # bf16 compute; narrower, for the compile's sake
    cfg.model = dataclasses.replace(cfg.model, num_layers=2, embed_dim=2048, mlp_dim=8192,
                                    num_heads=16, num_kv_heads=8)
    cfg.model.param_dtype = "bfloat16"  # with float32 master weights, as the NeMo recipe
    cfg.optim = dataclasses.replace(cfg.optim, master_weights=True)
    cfg.mesh = MeshConfig(data=8, zero_stage=zero)
    cfg.batch_size, cfg.seq_len, cfg.microbatches = 16, 512, 2
    cfg.compute = dataclasses.replace(cfg.compute, scan_layers=False)
    path = tmp_path / f"zero_{zero}.hlo"
    compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), hlo_path=str(path))
    d, f = cfg.model.embed_dim, cfg.model.mlp_dim
    found[zero] = _gradient_gemms(path.read_text(), {(d, f), (f, d)}, (cfg.model.vocab_size, d))
  assert found[2]["f32"] == 0 and found[2]["bf16"] >= 2, found  # the variants differ
  assert found[1]["adds"] == 0 and found[1]["f32"] == 6 and found[1]["bf16"] == 0, found
  # The table's rows scattered into its sum in place; no add of a whole [V, D] gradient.
  assert "scatter" in found[1]["table"] and not any("add" in n for n in found[1]["table"]), found


def _dots(jaxpr) -> int:
  """dot_general equations in a jaxpr and the jaxprs nested in its equations."""
  count = 0
  for eqn in jaxpr.eqns:
    count += eqn.primitive.name == "dot_general"
    for sub in jaxprs_in_params(eqn.params):
      count += _dots(sub)
  return count


@pytest.mark.parametrize("remat, dots", [("none", 3), ("selective", 3), ("full", 4)])
def test_a_summed_projection_is_kept_where_a_dot_would_be(remat, dots):
  """The summed projection is a custom_vjp, whose output no policy sees as a dot: named, it is
  kept by remat none and selective (3 GEMMs: forward, dx, dw) and recomputed by full (4)."""
  x, w = jnp.ones((4, 8)), jnp.ones((8, 16))

  def layer(x, w, total):
    y = checkpoint_name(summed_einsum("TD,DF->TF", x, w, total), PROJECTION)
    return jnp.sum(jnp.sin(y))

  checked = jax.checkpoint(layer, policy=REMAT_POLICIES[remat])
  jaxpr = jax.make_jaxpr(jax.grad(checked, argnums=(0, 2)))(x, w, jnp.zeros((8, 16)))
  assert _dots(jaxpr.jaxpr) == dots
