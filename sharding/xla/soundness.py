"""Checks that a compiled program is one XLA may legally run: what its own verifier misses."""

from sharding.xla import hlo

# What to do when a check fails: the option that keeps XLA from packing all-reduces at all.
_NO_PACKING = "xla_options=xla_gpu_all_reduce_combine_threshold_bytes=0"


def resized_bitcasts(hlo_text: str) -> list[str]:
  """'name: operand type -> type' of every bitcast whose bytes differ from its operand's. A
  bitcast only reinterprets a buffer, so one that changes its size reads or writes past it.
  XLA 0.10.2 (GPU) emits them when all-reduce reassociation leaves a bf16 all-reduce with an f32
  reduction, the combiner packs it with f32 all-reduces (it keys on the reduction's type) and
  the contiguous pass flattens the pack into the first operand's type: f32 sums are then added
  as pairs of bf16, and a buffer too small for the copy aborts the compile."""
  comps = hlo.computations(hlo_text)
  types = {i.name: i.type for instrs in comps.values() for i in instrs}
  found = []
  for instrs in comps.values():
    for i in instrs:
      if i.op != "bitcast" or not (names := hlo.operands(i)) or names[0] not in types:
        continue
      source = types[names[0]]
      if hlo.bytes_of(hlo.arrays(source)) != hlo.bytes_of(hlo.arrays(i.type)):
        found.append(f"{i.name}: {_plain(source)} -> {_plain(i.type)}")
  return found


def check(hlo_text: str) -> None:
  """Raises a one-line ValueError if the compiled program is unsound (resized_bitcasts)."""
  if found := resized_bitcasts(hlo_text):
    raise ValueError(
        f"XLA miscompiled the train step: {len(found)} bitcasts change their operand's size"
        f" ({found[0]}), from packing all-reduces of different dtypes into one; set"
        f" {_NO_PACKING}, or a layout without the mixed-dtype reductions")


def _plain(type_str: str) -> str:
  return ",".join(f"{d}[{','.join(map(str, s))}]" for d, s in hlo.arrays(type_str))
