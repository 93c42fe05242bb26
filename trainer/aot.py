"""The real train step compiled ahead of time for a target, locally or for a GPU cluster (what
`meshtron compile` and `plan --compile_top` report).

GPU targets are compiled without a GPU in a subprocess (JAX_PLATFORMS=cpu + the CUDA plugin of
the `gpu-aot` extra): a bad target config can crash XLA, and the crash must become one line.
"""

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import tempfile

from sharding.xla import compiled as compiled_report
from sharding.plan import hardware
from sharding.xla import presets, step_time
from trainer.config import TrainConfig, config_from_dict
from trainer.process import cpu_threads


def compile_locally(cfg: TrainConfig, target: str = "local", devices=None,
                    hlo_path: str = "", gpus_per_node: int = 8,
                    device_memory_bytes: int = 0) -> compiled_report.CompiledReport:
  """Compiles the train step from abstract inputs (nothing allocated) on `devices` (of
  `device_memory_bytes` each; this machine's: their own limit); a GPU program's step time is
  predicted from its scheduled HLO (sharding/xla/step_time.py)."""
  import jax

  from trainer.trainer import Trainer  # after the caller configured JAX's platforms and devices
  local = devices is None
  devices = jax.devices() if local else devices
  trainer = Trainer(cfg, devices)
  if local:  # this machine's devices: what they hold, for the report's fit verdict
    device_memory_bytes = trainer.memory_limit()[0]
  executable, seconds, remat_note = trainer.compile_step(device_memory_bytes, gpus_per_node)
  rep = compiled_report.report(executable, target, devices, seconds)
  if local:
    rep.memory_limit_bytes = device_memory_bytes
  tokens = cfg.batch_size * cfg.seq_len
  resolved = presets.resolve(cfg.xla_preset, dict(trainer.mesh.shape), cfg.microbatches)
  rep.extra = {
      "model": f"{cfg.model.num_params() / 1e9:.3f}B parameters, {cfg.model.num_layers} layers",
      "mesh": ", ".join(f"{k}={v}" for k, v in trainer.mesh.shape.items() if v > 1) or "1 device",
      "layout": f"zero_stage={cfg.mesh.zero_stage}, sequence_parallel="
                f"{cfg.mesh.sequence_parallel}, vocab_over_fsdp={trainer.layout.vocab_split},"
                f" microbatches={cfg.microbatches},"
                f" remat={cfg.compute.remat}",
      "tokens per step": tokens,
      **_stages(trainer.layout, cfg.model.num_layers),
      "xla options": f"preset {cfg.xla_preset} ({resolved})"
                     + (f" + {cfg.xla_options}" if cfg.xla_options else ""),
      "model FLOPs per device per step (6N + attention)":
          f"{cfg.model.flops_per_token(cfg.seq_len) * tokens / len(devices):.4g}",
      **({"xla rematerialization": remat_note} if remat_note else {}),
  }
  text = executable.as_text()
  profile = hardware.profile_of_device(getattr(devices[0], "device_kind", ""))
  if profile is not None and rep.is_scheduled:
    predicted = step_time.predict(text, profile, gpus_per_node)
    rep.step_time = predicted.summary(tokens, cfg.model.flops_per_token(cfg.seq_len) * tokens,
                                      len(devices), profile.peak_bf16_flops)
    rep.step_time["profile"] = profile.name
  if hlo_path:
    with open(hlo_path, "w") as f:
      f.write(text)
  return rep


def _stages(layout, num_layers: int) -> dict:
  """The pipeline split, for the report: layers per stage and the rows each stage stores."""
  split = layout.stage_split(num_layers)
  if not split:
    return {}
  rows = layout.layers_per_device(num_layers)
  padding = layout.pipeline * rows - num_layers
  return {"pipeline stages": f"{layout.pipeline} x {layout.virtual_stages} virtual, layers"
                             f" {'+'.join(map(str, split))}; each stage stores and runs at most"
                             f" {rows} layers ({padding} padding rows in all, skipped); the"
                             " memory below is every stage's (one SPMD program, padded alike)"}


def compile_for_gpus(cfg: TrainConfig, gpu: compiled_report.GpuTarget, hlo_path: str = "",
                     timeout: float = 1800) -> compiled_report.CompiledReport:
  """Compiles for a described GPU cluster (e.g. h100x64) in a subprocess; one-line errors."""
  target = gpu.name
  with tempfile.TemporaryDirectory() as tmp:
    request, response = os.path.join(tmp, "request.json"), os.path.join(tmp, "response.json")
    with open(request, "w") as f:
      json.dump({"config": dataclasses.asdict(cfg), "target": dataclasses.asdict(gpu),
                 "hlo_path": hlo_path}, f)
    env = {**cpu_threads.without_ours(os.environ), "JAX_PLATFORMS": "cpu",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    env.pop("XLA_FLAGS", None)  # fake CPU device counts do not belong in a GPU compile
    proc = subprocess.run([sys.executable, "-m", "trainer.aot", request, response],
                          capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode < 0:
      name = signal.Signals(-proc.returncode).name
      raise ValueError(f"XLA crashed with {name} while compiling for {target} ({gpu.topology});"
                       f" check the target config {gpu.config_path}")
    if proc.returncode != 0 or not os.path.exists(response):
      raise ValueError(f"compiling for {target} failed: {_failure(proc.stderr)}")
    with open(response) as f:
      return compiled_report.from_json(json.load(f))


def _failure(stderr: str) -> str:
  """The line of a failed compile's stderr that says what failed: the exception's (JAX appends
  a note on its filtered traceback after it), else the last line."""
  lines = [l for l in stderr.strip().splitlines() if l.strip()] or ["no output"]
  raised = [l for l in lines if re.match(r"\w+(Error|Exception)\b", l)]
  return raised[-1] if raised else lines[-1]


def _worker(request_path: str, response_path: str) -> None:
  """Subprocess body: the target's abstract GPU devices, then the same local compile."""
  with open(request_path) as f:
    request = json.load(f)
  cfg = config_from_dict(TrainConfig, request["config"])
  target = compiled_report.GpuTarget(**request["target"])
  try:
    devices = compiled_report.gpu_devices(target)
  except (ImportError, RuntimeError, NotImplementedError) as e:
    sys.exit(f"no deviceless GPU compiler: install the gpu-aot extra"
             f" (pip install -e '.[gpu-aot]') and keep JAX_PLATFORMS=cpu ({e})")
  try:
    rep = compile_locally(cfg, target.name, devices, request["hlo_path"], target.devices_per_host,
                          target.device_memory_bytes)
  except ValueError as e:
    sys.exit(str(e).splitlines()[0])
  rep.extra["device memory"] = f"{target.device_memory_bytes / 2**30:.1f} GiB ({target.gpu})"
  with open(response_path, "w") as f:
    json.dump(dataclasses.asdict(rep), f)


def compile_report(cfg: TrainConfig, target: str, hlo_path: str = ""):
  """(report, device memory bytes or None) for `local` or a GPU target name."""
  if target == "local":
    rep = compile_locally(cfg, hlo_path=hlo_path)
    return rep, rep.memory_limit_bytes or None
  gpu = compiled_report.parse_gpu_target(target)
  return compile_for_gpus(cfg, gpu, hlo_path), gpu.device_memory_bytes


if __name__ == "__main__":
  _worker(sys.argv[1], sys.argv[2])

