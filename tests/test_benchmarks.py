"""The benchmark scripts work, and the property the benchmarks rely on: no recompilation after the
first step, on the AOT path (`Trainer.compiled_step`) and on the jitted path (`Trainer.train_step`,
`Trainer.eval_step`), with JAX's cache-miss explanations on. The benchmarks are the `benchmarks`
package (`python -m benchmarks.<name>`); program_hashes' programs are the layout matrix's."""

import json
import logging
import os
import re

import jax
import numpy as np
import pytest

from benchmarks import peak, plot_sweep, program_hashes, sweep, train_step
from benchmarks.anchor_breakdown import memory_groups
from sharding import MeshConfig
from tests import parallel_harness as harness
from tests.test_parallel import LAYOUTS
from trainer.config import DataConfig, TrainConfig
from trainer.trainer import Trainer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def explain_cache_misses():
  jax.config.update("jax_explain_cache_misses", True)
  jax.config.update("jax_log_compiles", True)  # every lowering of a jitted function is logged
  yield
  jax.config.update("jax_log_compiles", False)
  jax.config.update("jax_explain_cache_misses", False)


def compiles(records, name: str) -> int:
  """How many times the jitted function `name` was lowered and compiled, from jax_log_compiles'
  "Compiling jit(NAME) ..." lines."""
  return sum(r.getMessage().startswith(f"Compiling jit({name})") for r in records)


def small_trainer(mesh: MeshConfig) -> Trainer:
  cfg = TrainConfig(mesh=mesh, batch_size=8, seq_len=32, steps=10, compilation_cache_dir="",
                    data=DataConfig(source="synthetic", eval_fraction=0.0), sample_tokens=0)
  cfg.model.num_layers = 2
  return Trainer(cfg)


def test_no_recompilation_after_the_first_step(explain_cache_misses, caplog):
  trainer = small_trainer(MeshConfig(data=1, fsdp=4, tensor=2))
  trainer.init_state()
  batches = trainer.iterator("train")
  with trainer.scope(), caplog.at_level(logging.WARNING):
    # First calls: each function traces and compiles once.
    trainer.state, metrics = trainer.train_step(trainer.state, trainer.to_device(next(batches)))
    first = float(metrics["loss"])
    trainer.eval_step(trainer.state.params, trainer.to_device(next(batches)))
    first_compiles = [compiles(caplog.records, n) for n in ("train_step", "eval_step")]
    caplog.clear()
    for _ in range(2):  # new batches, the donated state coming back: same shardings, same shapes
      trainer.state, metrics = trainer.train_step(trainer.state,
                                                  trainer.to_device(next(batches)))
    out = trainer.eval_step(trainer.state.params, trainer.to_device(next(batches)))
  assert np.isfinite(first) and np.isfinite(float(metrics["loss"]))
  assert float(out["tokens"]) > 0
  # Each compiled exactly once, at its first call, and never again.
  assert first_compiles == [1, 1]
  assert compiles(caplog.records, "train_step") == compiles(caplog.records, "eval_step") == 0
  # With jax_explain_cache_misses on, any retrace or recompile would be logged here.
  misses = [r.getMessage() for r in caplog.records if "cache miss" in r.getMessage().lower()]
  assert not misses, misses[:1]
  assert int(trainer.state.step) == 3


def test_train_step_benchmark_prints_one_json_line(tmp_path, capsys):
  """Runs the AOT `compiled_step` (an executable: it cannot recompile) step after step."""
  # The backend starts here with conftest's 8 devices, if no earlier test started it: main()
  # sets a device count for a fresh process, which would otherwise leave 4 to this process's
  # later tests (the sweep's 8-device layouts, when this file runs alone).
  assert len(jax.devices()) == 8
  peak_file = tmp_path / "peak.jsonl"
  peak_file.write_text(json.dumps({"benchmark": "matmul_peak", "dtype": "float32",
                                   "gflops": 100.0}) + "\n")
  train_step.main(["--model=debug", "--layout=fsdp=2,tensor=2", "--batch=4", "--seq=32",
                   "--steps=2", "--warmup=1", f"--peak_file={peak_file}", "--layers=2"])
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
  assert len(lines) == 1
  row = json.loads(lines[0])
  assert row["layout"] == "fsdp=2,tensor=2" and row["num_devices"] == 4
  assert row["tokens_per_s"] > 0 and row["compile_s"] > 0 and row["peak_gflops"] == 100.0
  assert row["mfu"] == pytest.approx(row["model_gflops_per_s"] / 100.0, rel=1e-2)
  assert row["memory_gib_per_device"]["peak"] > 0 and row["collective_mib_per_device"] > 0


def test_layout_strings_round_trip():
  layout = train_step.parse_layout("fsdp=4,tp=2,sp=1")
  assert layout == {"fsdp": 4, "tensor": 2, "sequence_parallel": True}
  assert train_step.layout_name(layout) == "fsdp=4,tensor=2,sp"
  assert train_step.layout_name({}) == "single"


def test_sweep_rows_measure_predict_and_skip(tmp_path):
  class Args:
    model, batch, seq, steps, warmup = "debug", 8, 32, 1, 1
  ok = sweep.run_one("sweep", dict(fsdp=4, tensor=2), 2, "full", Args, 100e9, 20e9)
  skipped = sweep.run_one("sweep", dict(fsdp=4, expert=2), 1, "none", Args, 100e9, 20e9)
  invalid = sweep.run_one("sweep", dict(fsdp=4, pipeline=2), 1, "none", Args, 100e9, 20e9)
  assert ok["status"] == "ok", ok["reason"]
  assert ok["tokens_per_s"] > 0 and ok["predicted_tokens_per_s"] > 0
  assert ok["mem_peak_gib"] > 0 and ok["predicted_mem_gib"] > 0
  assert skipped["status"] == "skipped" and "needs a MoE" in skipped["reason"]
  assert invalid["status"] == "error" and "microbatches" in invalid["reason"]
  assert all(sweep.devices_of(l) == 8 for l in sweep.LAYOUTS)  # every layout fills 8 devices
  path = tmp_path / "sweep.csv"
  with open(path, "w", newline="") as f:
    writer = __import__("csv").DictWriter(f, sweep.FIELDS)
    writer.writeheader()
    writer.writerows([ok, skipped, dict(ok, kind="scaling", layout="single", devices=1, fsdp=1,
                                        tensor=1)])
  plot_sweep.heatmap(plot_sweep.read(path), str(tmp_path / "heat.png"))
  plot_sweep.scaling(plot_sweep.read(path), str(tmp_path / "scale.png"))
  assert (tmp_path / "heat.png").stat().st_size > 1000
  assert (tmp_path / "scale.png").stat().st_size > 1000


def test_copy_bandwidth_is_measured():
  assert peak.measure_copy_bandwidth(mib=16, repeats=2) > 1e8  # > 0.1 GB/s


def test_maxtext_peer_runs_the_same_models():
  """benchmarks/peers/maxtext.sh sets the same dims as train_step.MODELS."""
  text = open(os.path.join(REPO, "benchmarks", "peers", "maxtext.sh")).read()
  keys = {"EMB": "embed_dim", "LAYERS": "num_layers", "HEADS": "num_heads",
          "KV_HEADS": "num_kv_heads", "HEAD_DIM": "head_dim", "MLP": "mlp_dim",
          "VOCAB": "vocab_size"}
  for model in ("tiny", "100m"):
    line = re.search(rf"^\s*{model}\) export (.*?);;", text, re.M).group(1)
    dims = dict(kv.split("=") for kv in line.split())
    assert {keys[k]: int(v) for k, v in dims.items()} == train_step.MODELS[model]


def test_program_hashes_hashes_the_layout_matrix_programs():
  """benchmarks.program_hashes keeps its own copy of the layout matrix (benchmarks import no
  tests): its 15 named layouts are tests/test_parallel.LAYOUTS (names, mesh configs, options, in
  order), its run is tests/parallel_harness's, and each of its programs is the config the
  harness builds for the same layout; its programs are those of the committed hashes."""
  assert list(program_hashes.LAYOUTS) == list(LAYOUTS)
  assert program_hashes.LAYOUTS == LAYOUTS
  for name in ("MODEL", "COMPUTE", "OPTIM", "BATCH", "SEQ", "STEPS"):
    assert getattr(program_hashes, name) == getattr(harness, name), name
  tables = {**program_hashes.cpu_table(), **program_hashes.gpu_table()}
  for name, (mesh_cfg, options) in tables.items():
    assert program_hashes.config(mesh_cfg, **options) == harness.config(mesh_cfg, **options), name
  programs = program_hashes.programs()
  for name, (mesh_cfg, options) in LAYOUTS.items():
    assert programs[name] == harness.config(mesh_cfg, **options), name
  gpu = program_hashes.gpu_programs()
  assert len(programs) == 21 and len(gpu) == 3 and not set(programs) & set(gpu)
  path = os.path.join(REPO, "benchmarks", "results", "program_hashes.jsonl")
  committed = [json.loads(line)["program"] for line in open(path, encoding="utf-8")]
  assert committed == [*programs, *gpu]


def test_the_anchor_breakdown_groups_memory_kernels_by_fusion_pass_and_primitive():
  """benchmarks/anchor_breakdown.py: memory-bound kernels of the same fusion kind, pass and JAX
  primitive are summed (numbered clones together), matrix kernels left out, costliest first."""
  hlo_text = "\n".join([
      '  %loop_dynamic_update_slice_fusion.3 = f32[2] fusion(%a), metadata={op_name='
      '"jit(train_step)/while/body/transpose(jvp())/dynamic_update_slice"}',
      '  %loop_dynamic_update_slice_fusion = f32[2] fusion(%b), metadata={op_name='
      '"jit(train_step)/while/body/transpose(jvp())/dynamic_update_slice"}',
      '  %loop_dynamic_update_slice_fusion.1 = f32[2] fusion(%c), metadata={op_name='
      '"jit(train_step)/while/body/jvp()/dynamic_update_slice"}',
      '  %gemm_fusion_dot.7 = f32[2] fusion(%d), metadata={op_name="jit(train_step)/dot_general"}'])
  ops = [{"name": "loop_dynamic_update_slice_fusion.3", "kind": "memory", "count": 4,
          "total_s": 0.25},
         {"name": "loop_dynamic_update_slice_fusion", "kind": "memory", "count": 4,
          "total_s": 0.5},
         {"name": "loop_dynamic_update_slice_fusion.1", "kind": "memory", "count": 8,
          "total_s": 0.5},
         {"name": "gemm_fusion_dot.7", "kind": "gemm", "count": 8, "total_s": 9.0}]
  assert memory_groups(hlo_text, ops) == [
      {"fusion": "dynamic_update_slice_fusion", "pass": "backward",
       "primitive": "dynamic_update_slice", "seconds": 0.75, "launches": 8},
      {"fusion": "dynamic_update_slice_fusion", "pass": "forward",
       "primitive": "dynamic_update_slice", "seconds": 0.5, "launches": 8}]
