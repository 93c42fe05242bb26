"""The analytic side of context parallelism's impls (ring, allgather, ulysses, ulysses_ring): how
each factors the context axis, the kv heads Ulysses attends, the bytes its all-to-alls move and
the layouts it rules out. sharding/context_parallel.py and kernels/ulysses.py run them; `model`
is a ModelSpec or anything with its field names."""

import math

from sharding.context_parallel import RING_IMPLS, load_balanced, ulysses_degree


def factors(model, layout) -> tuple[int, int]:
  """(ring size, Ulysses degree) of the context axis: (context, 1) for ring and allgather,
  (1, context) for ulysses, (context / degree, degree) for the hybrid."""
  degree = ulysses_degree(getattr(model, "context_impl", "ring"),
                          getattr(model, "ulysses_degree", 0), layout.context)
  return max(1, layout.context // degree), degree


def attended_kv_heads(model, layout) -> float:
  """kv heads per tensor shard that attention holds: K / tensor, or under Ulysses lcm(K / tensor,
  degree) (kernels/ulysses.kv_repeats: kv heads fewer than the degree are replicated)."""
  local, degree = model.num_kv_heads / layout.tensor, factors(model, layout)[1]
  return local if degree == 1 else math.lcm(max(1, int(local)), degree)


def ulysses_payload(model, layout, tokens: float, act_bytes: int) -> float:
  """Bytes one device's 4 forward all-to-alls of a layer move in all (q, k, v and the output,
  before or after the exchange: the same size), for `tokens` local tokens. The backward sends
  the gradients of the same 4 (their transposes)."""
  heads = model.num_heads // layout.tensor + attended_kv_heads(model, layout)
  return tokens * heads * (model.head_dim + model.v_head_dim()) * act_bytes


def sequence_chunks(model, context: int) -> int:
  """Chunks a sequence is cut into: 2 per device in the load-balanced (zigzag) order, 1 in the
  contiguous one (a sliding window, or Ulysses)."""
  balanced = load_balanced(getattr(model, "sliding_window", 0),
                           getattr(model, "context_impl", "ring"))
  return context * (2 if balanced and context > 1 else 1)


def runnable_impl(impl: str, layout) -> str:
  """The context-parallel impl `plan` weighs a layout with: `impl`, except that the default ring
  cannot run inside pipeline stages (sharding.resolution), where the all-gather takes its place
  (the layout's string then says cp_impl=allgather)."""
  return "allgather" if impl == "ring" and layout.pipeline > 1 and layout.context > 1 else impl


def errors(model, layout) -> list[str]:
  """The context-parallel constraints a layout breaks, as sentences (sharding.layout checks the
  same before compiling): no ring inside pipeline stages; the hybrid's degree divides `context`,
  the degree divides the query heads per tensor shard (kv heads fewer than it are replicated)."""
  impl, degree = getattr(model, "context_impl", "ring"), getattr(model, "ulysses_degree", 0)
  if layout.context > 1 and layout.pipeline > 1 and impl in RING_IMPLS:
    return [f"context_impl {impl} cannot run inside pipeline stages (allgather or ulysses can)"]
  if layout.context == 1 or impl not in ("ulysses", "ulysses_ring"):
    return []
  if impl == "ulysses" and degree not in (0, layout.context):
    return [f"ulysses_degree {degree} is neither 0 nor context={layout.context}"]
  if impl == "ulysses_ring" and layout.context % degree:
    return [f"context={layout.context} not divisible by ulysses_degree {degree}"]
  degree = factors(model, layout)[1]
  local = model.num_heads // layout.tensor
  if local % degree:
    return [f"query heads per tensor shard {local} not divisible by the Ulysses degree {degree}"
            " (kv heads fewer than it are replicated, query heads cannot be)"]
  return []


def ring_hops(m, context: int, seq_len: int) -> float:
  """K/V blocks the ring passes on per layer, mean over the layers: context - 1, or with a sliding
  window (contiguous order: kernels.ring_attention.ring_hops) only the blocks the window reaches;
  with full_attention_every = N, every Nth layer makes every hop."""
  full = context - 1
  if not m.sliding_window:
    return full
  windowed = min(full, -(-(m.sliding_window - 1) // (seq_len // context)))
  share = 1 / m.full_attention_every if m.full_attention_every else 0.0
  return share * full + (1 - share) * windowed
