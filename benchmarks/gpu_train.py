"""The train step of Llama-3-8B's dimensions, truncated to fit one GPU, measured on that GPU;
prints one JSON line. `make gpu-check` (benchmarks/gpu_check.py) runs one process per
configuration, so each line's measured peak memory is that configuration's alone.

The model: Llama-3-8B (D 4096, 32 heads / 8 kv heads of 128, F 14336, the 128,256-token
vocabulary, RoPE as Llama 3.1) with `--layers` layers (default 8), bf16 compute, float32 master
weights and AdamW state, synthetic tokens. The micro-batch is the largest of `--batches` whose
compiled program fits the GPU's memory (XLA_PYTHON_CLIENT_MEM_FRACTION, set by gpu_check.py).

FLOPs (the MFU numerator): `ModelConfig.flops_per_token`, 6 x the matmul parameters (head
included, embedding lookup not) + 6 x layers x heads x head dim x seq for causal attention (half
of the unmasked 12 x ...). MFU is reported against the GPU's bf16 data-sheet figure (H100 SXM:
989 TFLOP/s, as the published anchors count it) and against the bf16 matmul peak measured on
this GPU.

`--model=qwen3_30b_a3b|deepseek_v3_like` (the moe phase) measures a MoE preset cut to `--layers`
layers and `--experts` routed experts (its leading dense layers kept, as many as leave one MoE
layer; top-k and widths kept) with `--dispatch`; each line names the cut, and MFU counts the
active parameters (`flops_per_token`: the top-k experts).

With `--fp8=RECIPE` the projections run in fp8 (compute.fp8; the MFU numerator stays the same
FLOPs, against the bf16 figures), and `--xla_options` passes XLA options (e.g.
xla_gpu_enable_triton_gemm=false: cuBLASLt fp8 GEMMs instead of the autotuner's choice).

Usage: python -m benchmarks.gpu_train --attention=cudnn --remat=none [--batches=4,2,1]
         [--seq=4096] [--layers=8] [--steps=10] [--warmup=3] [--peak_tflops=N]
         [--fp8=tensorwise] [--xla_options=k=v] [--rehearse]
"""

import argparse
import dataclasses
import json

from benchmarks import train_step


# The moe phase's models (issue [24]): their widths, cut to a few layers and experts.
MOE_MODELS = ("qwen3_30b_a3b", "deepseek_v3_like")


def moe_model(name: str, layers: int, experts: int, dispatch: str, rehearse: bool,
              grouped_matmul: str = "auto"):
  """A MoE preset cut to `layers` layers (its leading dense layers kept, as many as fit) and
  `experts` routed experts (0: all; expert groups keep their count), top-k and widths kept;
  `grouped_matmul`: the dropless experts' kernel (auto: the Pallas kernel on GPUs)."""
  from configs import moe
  model = moe.model(name)
  routing = dict(num_experts=experts or model.moe.num_experts, dispatch=dispatch,
                 first_dense_layers=min(model.moe.first_dense_layers, layers - 1),
                 grouped_matmul=grouped_matmul)
  if rehearse:  # the same routing at a size the CPU runs in seconds
    model = dataclasses.replace(model, vocab_size=512, embed_dim=128, num_heads=4,
                                num_kv_heads=2, head_dim=32, mlp_dim=256)
    routing.update(num_experts=8, experts_per_token=2, expert_mlp_dim=64,
                   expert_groups=min(model.moe.expert_groups, 4),
                   groups_per_token=min(model.moe.groups_per_token, 2))
  return dataclasses.replace(model, num_layers=layers,
                             moe=dataclasses.replace(model.moe, **routing))


def cut_name(model) -> str:
  """What a line's model is: its layers (dense + MoE) and experts."""
  if model.moe is None:
    return f"{model.num_layers} layers"
  m = model.moe
  return (f"{model.num_layers} layers ({model.dense_layers()} dense + {model.moe_layers()} MoE),"
          f" {m.num_experts} experts top-{m.experts_per_token}, {m.dispatch}"
          + (f" ({m.grouped_matmul} grouped matmul)" if m.grouped_matmul != "auto" else ""))


def make_config(attention: str, remat: str, batch: int, seq: int, layers: int, rehearse: bool,
                fp8: str = "none", xla_options: str = "", model_name: str = "llama3_8b",
                experts: int = 0, dispatch: str = "dropless", grouped_matmul: str = "auto"):
  from configs import llama
  from models.fp8.config import Fp8Config
  from trainer.config import DataConfig
  cfg = llama.debug()
  if model_name in MOE_MODELS:
    model = moe_model(model_name, layers, experts, dispatch, rehearse, grouped_matmul)
  else:
    model = llama.model(model_name)
  if rehearse and model.moe is None:  # the same family at a size the CPU runs in seconds
    model = dataclasses.replace(model, vocab_size=512, embed_dim=128, num_heads=4,
                                num_kv_heads=2, head_dim=32, mlp_dim=256)
  fp8_config = Fp8Config() if fp8 == "none" else Fp8Config(enabled=True, recipe=fp8)
  cfg.model = dataclasses.replace(model, num_layers=layers)
  cfg.compute = dataclasses.replace(cfg.compute, attention_impl=attention, remat=remat,
                                    fp8=fp8_config)
  cfg.xla_options = xla_options
  cfg.batch_size, cfg.seq_len, cfg.sample_tokens = batch, seq, 0
  # Synthetic rows are one document each, so no document mask changes nothing but the program:
  # cuDNN's causal kernel without a [B, 1, L, L] mask bias (the first H200 visit read that bias in
  # every attention call; benchmarks/results/gpu/visits/2026-11-26b).
  cfg.data = DataConfig(source="synthetic", document_mask=False)
  cfg.compilation_cache_dir = ""  # compile time is part of the measurement
  return cfg


def gpu_op_ms(xplane_path: str, steps: int = 2) -> tuple[dict, list]:
  """Milliseconds per step of each GPU op (by name, numbers stripped) in a `jax.profiler` trace
  of `steps` steps, and the lines read: the XLA op lines of the GPU planes where the trace has
  them, else every kernel event on them."""
  import re
  import jax
  by_name, lines_used = {}, set()
  for plane in jax.profiler.ProfileData.from_file(xplane_path).planes:
    if not plane.name.startswith("/device:GPU"):
      continue
    lines = list(plane.lines)
    for line in [line for line in lines if line.name == "XLA Ops"] or lines:
      lines_used.add(line.name)
      for event in line.events:
        name = re.sub(r"\.\d+$", "", event.name)
        by_name[name] = by_name.get(name, 0.0) + event.duration_ns / 1e6 / steps
  return by_name, sorted(lines_used)


def trace_ops(trace_dir: str, top: int = 15) -> dict:
  """The GPU's busiest ops of the two traced steps (gpu_op_ms); {} without a trace."""
  import glob
  import os
  paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
  if not paths:
    return {}
  by_name, lines = gpu_op_ms(paths[-1])
  ranked = sorted(by_name.items(), key=lambda kv: -kv[1])[:top]
  return {"ms_per_step": {k: round(v, 3) for k, v in ranked},
          "total_ms_per_step": round(sum(by_name.values()), 3), "lines": lines}


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--attention", default="cudnn")
  parser.add_argument("--remat", default="none")
  parser.add_argument("--batches", default="4,2,1", help="micro-batches to try, largest first")
  parser.add_argument("--seq", type=int, default=4096)
  parser.add_argument("--layers", type=int, default=8)
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=3)
  parser.add_argument("--peak_tflops", type=float, default=0.0,
                      help="the measured bf16 matmul peak (0: report the data-sheet MFU only)")
  parser.add_argument("--fp8", default="none", help="none | delayed | tensorwise | rowwise |"
                      " blockwise")
  parser.add_argument("--xla_options", default="", help="k=v,... (TrainConfig.xla_options)")
  parser.add_argument("--model", default="llama3_8b",
                      help=f"llama3_8b, or a MoE cut: {', '.join(MOE_MODELS)}")
  parser.add_argument("--experts", type=int, default=0, help="MoE: routed experts (0: all)")
  parser.add_argument("--dispatch", default="dropless", help="MoE: dropless | dropping")
  parser.add_argument("--grouped_matmul", default="auto",
                      help="MoE, dropless: auto | pallas | ragged_dot (MoEConfig.grouped_matmul)")
  parser.add_argument("--hlo_out", default="", help="keep the compiled program here (.txt.gz)")
  parser.add_argument("--trace_dir", default="",
                      help="trace two steps after the timed ones; their GPU ops by time")
  parser.add_argument("--rehearse", action="store_true", help="CPU, a tiny model: the code path")
  args = parser.parse_args(argv)
  import jax
  from sharding.plan import hardware
  device = jax.devices()[0]
  # The data-sheet dense bf16 peak of this GPU (H100 SXM: 989 TFLOP/s); none on a CPU.
  profile = hardware.profile_of_device(device.device_kind)
  spec = profile.peak_bf16_flops if profile else 0.0
  fields = dict(benchmark="train_step", model=f"{args.model}_dims", layers=args.layers,
                attention=args.attention, remat=args.remat, seq=args.seq, dtype="bfloat16",
                fp8=args.fp8, xla_options=args.xla_options)
  if args.model in MOE_MODELS:
    fields.update(experts=args.experts, dispatch=args.dispatch,
                  grouped_matmul=args.grouped_matmul)
  tried = []
  for batch in map(int, args.batches.split(",")):
    cfg = make_config(args.attention, args.remat, batch, args.seq, args.layers, args.rehearse,
                      args.fp8, args.xla_options, args.model, args.experts, args.dispatch,
                      args.grouped_matmul)
    fields["cut"] = cut_name(cfg.model)
    try:
      result = train_step.measure(cfg, [device], steps=args.steps, warmup=args.warmup,
                                  peak_flops=args.peak_tflops * 1e12, hlo_path=args.hlo_out,
                                  after_trace_dir=args.trace_dir)
    except ValueError as e:  # the compiled program does not fit: try the next micro-batch
      if "GiB per device" not in str(e):
        raise
      tried.append({"batch": batch, "error": str(e).splitlines()[0]})
      continue
    break
  else:
    print(json.dumps({**fields, "status": "oom", "tried": tried}), flush=True)
    return
  stats = device.memory_stats() or {}
  tokens_per_s = result["tokens_per_s"]
  flops_per_token = cfg.model.flops_per_token(cfg.seq_len)
  compiled_peak = result["memory_gib_per_device"]["peak"]
  measured_peak = stats.get("peak_bytes_in_use", 0) / 2**30
  # The step predicted from this very program (the `predict` phase): as `meshtron compile`
  # predicts it for a cluster, with the profile of this GPU's kind.
  predicted = result.get("predicted", {})
  predicted_s = predicted.get("step_s")
  print(json.dumps({
      **fields, "status": "ok", "batch": cfg.batch_size, "tried_larger": tried,
      "params_b": round(cfg.model.num_params() / 1e9, 3),
      "active_params_b": round(cfg.model.active_params() / 1e9, 3),
      "flops_per_token": flops_per_token,
      "flops_counted": "6N (matmul params incl. head) + 6 x layers x heads x head_dim x seq",
      "tokens_per_s": tokens_per_s, "step_s": result["step_s"],
      "step_s_min": result["step_s_min"], "step_s_max": result["step_s_max"],
      "spec_tflops": spec / 1e12 or None,
      "mfu_vs_spec": round(flops_per_token * tokens_per_s / spec, 4) if spec else None,
      "mfu_vs_measured_peak": result["mfu"], "measured_peak_tflops": args.peak_tflops or None,
      "xla_flops_per_step": result["xla_flops_per_device"],
      "compile_s": result["compile_s"], "loss": result["loss"],
      "compiled_peak_gib": compiled_peak, "measured_peak_gib": round(measured_peak, 3),
      "measured_over_compiled": round(measured_peak / compiled_peak, 3) if compiled_peak else None,
      "memory_limit_gib": round(stats.get("bytes_limit", 0) / 2**30, 2),
      "predicted_step_s": round(predicted_s, 5) if predicted_s else None,
      "predicted_over_measured": round(predicted_s / result["step_s"], 3) if predicted_s
      else None, "predicted": predicted,
      "trace_ops": trace_ops(args.trace_dir) if args.trace_dir else None,
      "device": device.device_kind, "platform": device.platform}), flush=True)


if __name__ == "__main__":
  main()
