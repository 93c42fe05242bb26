"""GPU profiles: each GPU model's spec-sheet figures, the analytic model's calibrated factors and
the compiled-program model's measured constants, each with its source; a profile by name, from a
JSON file, or of a JAX device."""

import dataclasses
import json
import os


@dataclasses.dataclass(frozen=True)
class HardwareProfile:
  """One GPU model in a cluster. Peak numbers are dense (no sparsity) spec-sheet values; the
  efficiency and overlap factors are calibrated (see tests/test_planner.py for the points)."""

  name: str
  memory_bytes: float
  peak_bf16_flops: float
  peak_fp8_flops: float
  hbm_bandwidth: float  # bytes/s
  intra_node_bandwidth: float  # NVLink, bytes/s per GPU per direction
  inter_node_bandwidth: float  # NIC bytes/s per GPU per direction
  gpus_per_node: int = 8
  matmul_efficiency: float = 0.40  # fraction of peak the layers' matmuls reach
  collective_efficiency: float = 0.8  # fraction of link bandwidth a ring collective reaches
  intra_latency_s: float = 25e-6  # per ring step
  inter_latency_s: float = 8e-6
  layer_overhead_s: float = 60e-6  # kernel launches and small ops per layer pass
  # Per microbatch hop between pipeline stages on different nodes: the playbook's cross-node
  # pipeline runs lose far more time than their bytes explain (blocking sends per microbatch).
  pipeline_hop_s: float = 8e-3
  # Fraction of each kind of communication hidden behind compute.
  overlap: tuple = (("grad_sync", 0.8), ("param_sync", 0.0), ("zero3", 0.8), ("tensor", 0.2),
                    ("context", 0.8), ("pipeline", 0.5), ("expert", 0.0))
  # ---- the compiled-program model (sharding/xla/step_time.py); each value's source below ----
  gemm_peak_fraction: float = 0.807  # of the peak (bf16, or fp8 for f8 GEMMs) a large GEMM reaches
  flash_triton_fraction: float = 0.35  # of peak, a Triton (Pallas) flash-attention kernel
  flash_cudnn_fraction: float = 0.60  # of peak, cuDNN's fused attention
  grouped_matmul_fraction: float = 0.21  # of the bf16 peak, our Pallas grouped matmul (MoE)
  copy_bandwidth: float = 3.0e12  # bytes/s read + written by a memory-bound kernel
  kernel_overhead_s: float = 3e-6  # per kernel launch
  nvlink_busbw: float = 460e9  # bus bandwidth of a collective inside a node, bytes/s
  network_busbw_per_gpu: float = 50e9  # bus bandwidth per GPU of a collective across nodes
  collective_latency_s: float = 20e-6  # per collective inside a node
  network_latency_s: float = 30e-6  # per collective across nodes

  def overlap_of(self, phase: str) -> float:
    return dict(self.overlap)[phase]

  def summary(self) -> str:
    """One line of the figures `plan` prints for the GPU."""
    return (f"{self.name}: {self.memory_bytes / 1e9:.0f} GB, {self.peak_bf16_flops / 1e12:.0f}"
            f" TFLOP/s bf16, NVLink {self.intra_node_bandwidth / 1e9:.0f} GB/s, network"
            f" {self.inter_node_bandwidth / 1e9:.0f} GB/s per GPU, {self.gpus_per_node} per node")


GIB = 2 ** 30
# Public spec sheets. H100 SXM5: 989 TFLOP/s bf16 and 1979 fp8 dense, 80 GB HBM3 at 3.35 TB/s,
# NVLink 900 GB/s bidirectional (nvidia.com/en-us/data-center/h100); DGX H100: 8x 400 Gb/s
# ConnectX-7, 50 GB/s per GPU (the playbook's cluster: AWS p5, 3200 Gb/s EFA per 8 GPUs).
# H200: same compute, 141 GB HBM3e at 4.8 TB/s (nvidia.com/en-us/data-center/h200).
# A100 80GB SXM: 312 TFLOP/s bf16, no fp8, 2.04 TB/s, NVLink 600 GB/s, 200 Gb/s HDR per GPU
# (nvidia.com/en-us/data-center/a100). B200 (HGX B200): 2.25 PFLOP/s bf16 and 4.5 fp8 dense,
# 180 GB HBM3e at 8 TB/s, NVLink 5 1.8 TB/s, 400 Gb/s per GPU (nvidia.com/en-us/data-center/hgx).
#
# The compiled-program model's constants (fixed before its comparison with published anchors):
# - gemm_peak_fraction: a 8192^3 bf16 matrix product of random data ran at 798 TFLOP/s on this
#   workplace's H100 (device machine notes, 2026-11-13) and 769-798 on its H200 (2026-11-04):
#   798 / 989.4 = 0.807 (H100), 0.80 (H200). A100/B200: the H100 figure, not measured. fp8
#   GEMMs (sharding/xla/step_time.py: cuBLASLt fp8 calls, dots on f8 operands) take the same
#   fraction of peak_fp8_flops, not measured here: a public cuBLASLt e4m3 x e4m3 -> bf16 8192^3
#   benchmark on 16 Hopper SXM GPUs ran at 1,599-1,631 TFLOP/s, 0.81-0.82 of 1,979
#   (gitea.d-robotics.cc/han.zhao/test_gpu_scripts, reports_cublaslt_fp8_crosscheck_20260524.md).
# - flash_triton_fraction: FlashAttention-2 (the Triton/Pallas kernel's algorithm) reaches 35% of
#   an H100's bf16 peak (FlashAttention-3, arXiv:2407.08608, abstract). flash_cudnn_fraction:
#   cuDNN's fused attention about 600 of 989 TFLOP/s at head dim 128 (ibid., Fig. 5), approximate.
# - grouped_matmul_fraction: the Pallas grouped-matmul kernels (kernels/grouped_matmul.py) in the
#   traces of the dropless MoE cuts on the lent H200 (benchmarks/results/gpu/visits/2026-11-27c:
#   each cut's trace and GPU program): 12 calls a step, forward, recomputed forward, dx and dW of
#   three projections. DeepSeek-V3 cut 9.24e13 FLOPs in 433.4 ms (213 TFLOP/s, 0.215 of 989.4),
#   Qwen3 cut 3.96e13 in 196.3 ms (202 TFLOP/s, 0.204): 0.21 (tests/test_step_time.py
#   recomputes both). A100/B200: that fraction of their peak, not measured. The fp8 variant
#   (Triton's f8 dot) is priced at the bf16 rate: not measured.
# - copy_bandwidth: a device-to-device copy moved 3.0 TB/s (read + write) on this workplace's
#   H100 and 4.3 TB/s on its H200 (device machine notes); A100/B200: 90% of the data sheet.
# - kernel_overhead_s: ~2.5 us of dispatch per kernel (a 24 us kernel took 25.8 us from a CUDA
#   graph, 28.3 us by cuLaunchKernel: dogacel.github.io, 2026-03-14); 3 us here.
# - nvlink_busbw: nccl-tests all_reduce_perf bus bandwidth at large sizes on 8x H100 SXM5,
#   460-480 GB/s (docs.alayanew.com, 2026-05-06); the low end. network_busbw_per_gpu: NVLink +
#   NDR InfiniBand clusters reach 400-450 GB/s of all_reduce bus bandwidth per 8-GPU node
#   (saturncloud.io, Crusoe NCCL validation): 400 / 8 = 50 GB/s per GPU, its NIC's line rate.
# - collective_latency_s, network_latency_s: nccl-tests' small-message all_reduce times on one
#   and on several H100 nodes, about 20 and 30 us; approximate readings.
PROFILES = {
    "h100": HardwareProfile("h100", 80e9, 989.4e12, 1978.9e12, 3.35e12, 450e9, 50e9),
    "h200": HardwareProfile("h200", 141e9, 989.4e12, 1978.9e12, 4.8e12, 450e9, 50e9,
                            gemm_peak_fraction=0.80, copy_bandwidth=4.3e12),
    "a100": HardwareProfile("a100", 80e9, 312e12, 312e12, 2.039e12, 300e9, 25e9,
                            copy_bandwidth=0.9 * 2.039e12, nvlink_busbw=240e9,
                            network_busbw_per_gpu=25e9),
    "b200": HardwareProfile("b200", 180e9, 2250e12, 4500e12, 8e12, 900e9, 50e9,
                            copy_bandwidth=0.9 * 8e12, nvlink_busbw=2 * 460e9),
}


def profile_of_device(device_kind: str) -> HardwareProfile | None:
  """The built-in profile of a JAX device kind (e.g. "NVIDIA H100 80GB HBM3"); None for others
  (CPUs, unknown GPUs)."""
  kind = device_kind.lower()
  return next((p for name, p in PROFILES.items() if name in kind), None)


def load_profile(name_or_path: str) -> HardwareProfile:
  """A built-in profile by name, or a JSON file of HardwareProfile fields (optionally
  `"base": "h100"` to start from a built-in one)."""
  key = name_or_path.strip().lower()
  if key in PROFILES:
    return PROFILES[key]
  if not key.endswith(".json"):
    raise ValueError(f"unknown gpu {name_or_path!r}; use one of {', '.join(PROFILES)} or a"
                     " path/to/profile.json")
  if not os.path.exists(name_or_path):
    raise ValueError(f"hardware profile file {name_or_path} does not exist")
  with open(name_or_path) as f:
    values = json.load(f)
  base = PROFILES.get(values.pop("base", "h100"))
  fields = {f.name for f in dataclasses.fields(HardwareProfile)}
  unknown = set(values) - fields
  if base is None or unknown:
    raise ValueError(f"{name_or_path}: unknown keys {sorted(unknown)} or base; fields:"
                     f" {', '.join(sorted(fields))}")
  if "overlap" in values:
    values["overlap"] = tuple(dict(dict(base.overlap), **values["overlap"]).items())
  return dataclasses.replace(base, **values)
