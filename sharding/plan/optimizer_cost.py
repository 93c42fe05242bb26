"""Analytic costs of the optimizer and precision choices, on top of sharding.plan.estimate: Muon's
state and Newton-Schulz FLOPs and communication, and the fp8 amax-history state. `run_memory` is
what the trainer's pre-compile memory check and `meshtron memory --config` count for a run.

Pure Python, like estimate.py (which is near its size cap; this extends its model additively).
"""

import dataclasses

from sharding.plan.estimate import (DTYPE_BYTES, Layout, Memory, Precision, memory, model_spec,
                               shards, stage_layers)


def muon_matrices(model) -> list[tuple[int, int, int]]:
  """Every matrix Muon orthogonalizes in one layer, as (count, fan_in, fan_out): q, k, v, o, the
  dense (or shared-expert) SwiGLU and each routed expert's; the router, embedding, head and
  norms are trained by AdamW (trainer/optim.py muon_dims)."""
  m = model_spec(model)
  d, dh, h = m.embed_dim, m.head_dim, m.num_heads
  out = [(1, d, h * dh), (2, d, m.num_kv_heads * dh), (1, h * dh, d)]
  if m.mla is not None:  # q (from its latent or x), kv latent + rope key, kv up, o
    a = m.mla
    q = [(1, d, a.q_lora_rank), (1, a.q_lora_rank, h * dh)] if a.q_lora_rank else [(1, d, h * dh)]
    out = q + [(1, d, a.kv_lora_rank + a.qk_rope_head_dim),
               (1, a.kv_lora_rank, h * (a.qk_nope_head_dim + a.v_head_dim)),
               (1, h * a.v_head_dim, d)]
  moe = m.moe
  if moe is None:
    out += [(2, d, m.mlp_dim), (1, m.mlp_dim, d)]
  else:
    f = moe.expert_mlp_dim
    if moe.shared_experts:
      out += [(2, d, moe.shared_experts * f), (1, moe.shared_experts * f, d)]
    out += [(2 * moe.num_experts, d, f), (moe.num_experts, f, d)]
  return out


def muon_params(model) -> int:
  """Parameters under Muon (all layers)."""
  return model_spec(model).num_layers * sum(c * a * b for c, a, b in muon_matrices(model))


def muon_memory(model, layout: Layout, seq_len: int, precision: Precision, **kw) -> Memory:
  """estimate.memory with Muon for the hidden matrices: one momentum buffer where AdamW keeps two
  moments (the rest of the model keeps AdamW's two)."""
  mem = memory(model, layout, seq_len, precision, **kw)
  per_device = muon_params(model) / (layout.tensor * layout.pipeline * shards(layout)[2])
  return dataclasses.replace(mem, optimizer=mem.optimizer - precision.opt_bytes * per_device)


@dataclasses.dataclass(frozen=True)
class NewtonSchulzCost:
  flops: float  # per device per optimizer step
  wire_bytes: float  # sent per device per optimizer step


def muon_newton_schulz(model, layout: Layout, steps: int = 5, dtype: str = "float32"
                       ) -> NewtonSchulzCost:
  """Newton-Schulz cost of one Muon step, per device.

  Per matrix X [m, n] (m <= n after the optional transpose) and iteration: A = X X^T (2 m^2 n
  FLOPs), B = b A + c A^2 (2 m^3), X' = a X + B X (2 m^2 n). The update is sharded like the
  optimizer state (fsdp/ZeRO over the embed dim, tensor over heads/mlp); GSPMD runs the matmuls
  sharded, so the FLOPs divide by the matrix's shards s. Communication: the contraction of
  X X^T runs over a sharded dim, so each iteration all-reduces the [m, m] Gram matrix over the
  s shards (ring: 2 (s - 1) / s x its bytes per device); B and the next X need nothing more.
  (When a dim is not split evenly XLA may choose other collectives; this is the lower bound of
  the sharded algorithm, not a gathered-per-matrix one, which would move 2 m n per matrix.)
  """
  m = model_spec(model)
  s = layout.tensor * shards(layout)[2]
  layers = stage_layers(m, layout)
  flops = wire = 0.0
  for count, a, b in muon_matrices(model):
    small, large = min(a, b), max(a, b)
    flops += count * steps * (4 * small * small * large + 2 * small ** 3)
    if s > 1:
      wire += count * steps * 2 * (s - 1) / s * small * small * DTYPE_BYTES[dtype]
  return NewtonSchulzCost(layers * flops / s, layers * wire)


def fp8_state_elements(model, history: int, targets: str = "attention,mlp,experts",
                       recipe: str = "delayed") -> int:
  """float32 amax-history elements of fp8 training: 3 histories (input, weight, gradient) per fp8
  projection under the delayed recipe (the current-scaling ones keep none). They are parameters,
  so AdamW keeps (untouched) moments for them too."""
  if recipe != "delayed":
    return 0
  m = model_spec(model)
  per_layer = 4 * ("attention" in targets)
  if m.moe is None:
    per_layer += 3 * ("mlp" in targets)
  else:
    per_layer += 3 * ("experts" in targets) + 3 * ("mlp" in targets and m.moe.shared_experts > 0)
  head = "head" in targets and not m.tie_embeddings
  return 3 * history * (m.num_layers * per_layer + head)


def run_memory(model, layout: Layout, seq_len: int, precision: Precision, *,
               optimizer: str = "adamw", fp8=None, **kw) -> Memory:
  """The per-device memory of a run's choices: estimate.memory, with Muon's one momentum for its
  hidden matrices (`optimizer` "muon"), plus the fp8 amax histories of `fp8` (a Fp8Config, read
  by field names; None or disabled: none), float32 parameters replicated on every device with
  AdamW's two (untouched) moments: 3 x 4 bytes an element."""
  mem = (muon_memory if optimizer == "muon" else memory)(model, layout, seq_len, precision, **kw)
  if fp8 is None or not fp8.enabled:
    return mem
  histories = fp8_state_elements(model, fp8.amax_history, fp8.targets, fp8.recipe)
  return dataclasses.replace(mem, params=mem.params + 4 * histories,
                             optimizer=mem.optimizer + 8 * histories)
