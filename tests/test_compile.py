"""`meshtron compile`: reports of the real compiled program, on CPU and for GPUs with no GPU.

The GPU programs come from deviceless compiles (the `gpu-aot` extra) in a subprocess. Psi is the
parameter bytes (float32); formulas are stated next to each assertion.
"""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import pytest

from configs import llama
from sharding import MeshConfig
from sharding.xla import compiled
from trainer.aot import compile_for_gpus, compile_locally, compile_report

MESHTRON = os.path.join(os.path.dirname(sys.executable), "meshtron")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def debug(batch_size=64, **mesh):
  cfg = llama.debug()
  cfg.mesh = MeshConfig(**{"data": 1, **mesh})
  cfg.batch_size, cfg.seq_len = batch_size, 64
  return cfg


PSI = debug().model.num_params() * 4
LAYERS = debug().model.num_layers


@functools.lru_cache(maxsize=None)
def gpu_report(target: str, batch_size: int = 64, **mesh) -> compiled.CompiledReport:
  return compile_for_gpus(debug(batch_size, **mesh), compiled.parse_gpu_target(target))


def kinds(rep):
  return {c["kind"] for c in rep.collectives}


def test_a_local_compile_says_whether_it_fits_this_machine():
  """`meshtron compile` (target local) reports the fit against what this machine's devices hold:
  --config.device_memory_gib when set, else each CPU device's share of the host's available
  memory."""
  small = debug(data=8)
  small.device_memory_gib = 0.001
  rep, limit = compile_report(small, "local")
  assert limit == rep.memory_limit_bytes == int(0.001 * 2**30) < rep.memory["peak"]
  assert "fits in 0.0 GiB: NO (short by" in compiled.format_report(rep, limit)
  rep, limit = compile_report(debug(data=8), "local")
  assert limit > rep.memory["peak"] and ": yes" in compiled.format_report(rep, limit)


def test_local_report_has_memory_flops_and_collectives():
  rep = compile_locally(debug(fsdp=4, tensor=2))
  assert rep.platform == "cpu" and rep.num_devices == 8
  assert rep.memory["argument"] > 0 and rep.memory["temp"] > 0
  assert rep.memory["peak"] >= rep.memory["argument"] + rep.memory["temp"] - rep.memory["alias"]
  assert rep.flops and rep.flops > 0  # XLA:CPU's cost analysis
  assert {"all-gather", "all-reduce"} <= kinds(rep)
  assert rep.wire_bytes == pytest.approx(sum(c["total_wire_bytes"] for c in rep.collectives))
  text = compiled.format_report(rep, 2**30)
  assert "fits in 1.0 GiB: yes" in text and "all-gather" in text


def test_cli_json_and_hlo_dump(tmp_path):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  hlo_path = tmp_path / "step.hlo"
  result = subprocess.run(
      [MESHTRON, "compile", "--cpu_devices=8", "--config.mesh.data=8", "--json",
       f"--hlo={hlo_path}", "--config.model.num_layers=2", "--config.device_memory_gib=0.001"],
      capture_output=True, text=True, env={**env, "JAX_PLATFORMS": "cpu"}, cwd=REPO, timeout=600)
  assert result.returncode == 0, result.stderr[-2000:]
  report = json.loads(result.stdout.strip().splitlines()[-1])
  assert report["num_devices"] == 8 and report["summary"]["all-reduce"]["executions"] >= 1
  assert hlo_path.read_text().startswith("HloModule")
  # A step that does not fit says so on stderr too (a --json reader sees it), exit code 0.
  warning = [line for line in result.stderr.splitlines() if line.startswith("meshtron: warn")]
  assert len(warning) == 1 and "does not fit local: its peak is" in warning[0]
  assert "the device has 0.0 GiB; `meshtron plan` lists layouts that fit" in warning[0]


def test_unknown_target_is_one_line():
  with pytest.raises(ValueError, match="unknown target 'tpu9'"):
    compiled.parse_gpu_target("tpu9")
  with pytest.raises(ValueError, match="multiple of 8"):
    compiled.parse_gpu_target("h100x12")
  assert compiled.parse_gpu_target("h100x64").topology == "1x8x8"
  assert compiled.parse_gpu_target("h200x4").topology == "1x1x4"


def test_h100x8_program_is_scheduled_and_async():
  rep = gpu_report("h100x8", fsdp=4, tensor=2)
  assert rep.platform != "cpu" and rep.num_devices == 8
  assert rep.is_scheduled  # XLA:GPU's latency-hiding scheduler ran
  assert rep.collectives and rep.async_fraction == 1.0  # every collective is a start/done pair
  assert rep.memory["peak"] > 0 and rep.memory["temp"] > 0
  # FSDP on GPU reduce-scatters gradients (XLA:CPU would all-reduce and slice).
  assert {"all-gather", "reduce-scatter", "all-reduce"} <= kinds(rep)
  # TP: 2 all-reduces of b x s x h forward + 2 backward per layer, inside the layer scans.
  # (As [b·s, h] token rows: no mesh axis splits the sequence; models/layers.Einsum.)
  bsh = (64 // 4 * 64, 128)
  assert sum(c["count"] for c in rep.collectives
             if c["kind"] == "all-reduce" and tuple(c["shape"]) == bsh and c["count"] > 1) \
      == 4 * LAYERS
  assert compiled.fits(rep, compiled.parse_gpu_target("h100x8").device_memory_bytes)[0]


def test_h100x64_zero3_stores_one_64th_per_device():
  rep = gpu_report("h100x64", fsdp=64)
  assert rep.num_devices == 64 and rep.is_scheduled
  # Parameters + Adam moments sharded 64 ways, except the norm scales (no `embed` dim), which
  # every device keeps whole: 3 (Psi - Psi_norms) / 64 + 3 Psi_norms of arguments besides the
  # batch (5 arrays of 64 x 64 over 64 devices). The gradients are temporaries of Psi / 64.
  model = debug().model
  psi_norms = (2 * model.num_layers + 1) * model.embed_dim * 4
  state_bytes = rep.memory["argument"] - 5 * 64 * 64 * 4 // 64
  assert state_bytes == pytest.approx(3 * (PSI - psi_norms) / 64 + 3 * psi_norms, rel=0.01)
  assert state_bytes < 1.1 * 3 * PSI / 64  # about 1/64 of the 3 Psi total
  assert "reduce-scatter" in kinds(rep) and rep.async_fraction == 1.0


@pytest.mark.parametrize("mesh", [dict(data=8, zero_stage=2), dict(tensor=2, data=4,
                                                                   sequence_parallel=True)])
def test_gpu_programs_reduce_scatter_where_the_playbook_says(mesh):
  """ZeRO-2: gradients reduce-scattered (Psi), then parameters all-gathered (Psi). SP: the
  all-reduces of TP become all-gather + reduce-scatter of the same activations."""
  rep = gpu_report("h100x8", **mesh)
  assert {"reduce-scatter", "all-gather"} <= kinds(rep)
  if "zero_stage" in mesh:
    scattered = rep.summary["reduce-scatter"]["payload_bytes"]
    gathered = rep.summary["all-gather"]["payload_bytes"]
    assert scattered == pytest.approx(PSI, rel=0.01)
    assert gathered == pytest.approx(PSI, rel=0.01)


def test_xla_crash_becomes_one_line_error(tmp_path):
  """A target config with only the compute capability crashes XLA (SIGFPE); the subprocess
  turns that into a clear error instead of killing meshtron."""
  broken = tmp_path / "broken.txtpb"
  broken.write_text('gpu_device_info { cuda_compute_capability { major: 9 minor: 0 } }\n'
                    'platform_name: "CUDA"\n')
  target = dataclasses.replace(compiled.parse_gpu_target("h100x8"), config_path=str(broken))
  with pytest.raises(ValueError, match="XLA crashed with SIG[A-Z]+ while compiling for h100x8"):
    compile_for_gpus(debug(data=8), target)


def test_train_refuses_a_layout_that_does_not_fit(tmp_path):
  """0.1 GiB: above the analytic estimate of the debug step with full recomputation on one
  device (0.085 GiB, checked before compiling; tests/test_errors.py), below its compiled peak
  (0.104 GiB)."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  result = subprocess.run(
      [MESHTRON, "train", "--cpu_devices=1", "--config.device_memory_gib=0.1",
       "--config.compute.remat=full",
       f"--workdir={tmp_path}"], capture_output=True, text=True,
      env={**env, "JAX_PLATFORMS": "cpu"}, cwd=REPO, timeout=600)
  assert result.returncode != 0
  last = result.stderr.strip().splitlines()[-1]
  assert "the compiled train step needs" in last and "device_memory_gib allows 0.10 GiB" in last
  assert not (tmp_path / "metrics.jsonl").exists()  # refused before training started


def test_gpu_report_predicts_the_step_from_the_scheduled_program():
  """sharding/xla/step_time.py on the compiled H100 program (its formulas: test_step_time.py):
  the step is at least its kernels and at most kernels + every collective; tokens/s/GPU is the
  step's tokens over its time and devices; a CPU program gets no prediction."""
  rep = gpu_report("h100x8", fsdp=4, tensor=2)
  st = rep.step_time
  assert st["profile"] == "h100" and st["compute_s"] > 0
  assert st["compute_s"] <= st["step_s"] <= st["compute_s"] + st["communication_s"] + 1e-12
  assert st["exposed_communication_s"] == pytest.approx(st["step_s"] - st["compute_s"])
  assert st["tokens_per_s_per_gpu"] == pytest.approx(64 * 64 / st["step_s"] / 8)
  totals = [op["total_s"] for op in st["top_ops"]]
  assert len(totals) == 10 and totals == sorted(totals, reverse=True)
  assert "predicted step" in compiled.format_report(rep)
  assert compile_locally(debug(data=8)).step_time == {}


def test_auto_attention_is_a_flash_kernel_on_gpu_targets_and_xla_on_cpu(tmp_path):
  """The default attention_impl "auto": the H100 program holds the Pallas flash kernels, the
  CPU program of the same config none; the H100 program of a pipelined layout holds them too
  (the kernel's shard_map nests in the stage's)."""
  cfg = debug(data=8)
  assert cfg.compute.attention_impl == "auto"
  gpu_hlo, cpu_hlo = tmp_path / "gpu.hlo", tmp_path / "cpu.hlo"
  compile_for_gpus(cfg, compiled.parse_gpu_target("h100x8"), str(gpu_hlo))
  compile_locally(cfg, hlo_path=str(cpu_hlo))
  assert "flash_attention_fwd" in gpu_hlo.read_text()
  assert "flash_attention" not in cpu_hlo.read_text()
  piped = debug(data=4, pipeline=2)
  piped.microbatches = 4
  compile_for_gpus(piped, compiled.parse_gpu_target("h100x8"), str(gpu_hlo))
  text = gpu_hlo.read_text()
  assert "flash_attention_fwd" in text and "collective-permute" in text
