"""A layout's text form ("data=4,tensor=2,zero=1,ga=16,...", what `meshtron plan` prints and
`--layout` takes): `parse` reads it back into a Layout (`Layout.string` writes it), with one-line
errors for what cannot be one."""

from sharding.context_parallel import CONTEXT_IMPLS
from sharding.layout import ALIASES, REMATS, Layout
from sharding.mesh import AXES, LayoutError
from sharding.pipeline import schedules, stage_split

_INTS = (*AXES, "zero_stage", "virtual_stages", "micro_batch", "microbatches")


def parse(text: str) -> Layout:
  """A Layout from "data=4,tensor=2,pipeline=2,zero=1,mbs=4,ga=16,remat=selective,sp=1,
  schedule=1f1b" (any subset, any order; mesh names or the aliases dp/tp/pp/cp/ep). One-line
  LayoutError for anything else."""
  values = {}
  for item in filter(None, (p.strip() for p in text.split(","))):
    key, sep, value = (part.strip() for part in item.partition("="))
    field = ALIASES.get(key, key)
    if not sep or not value:
      raise LayoutError(f"layout item {item!r} must look like key=value")
    if field in _INTS:
      if not value.isdigit() or (int(value) < 1 and field != "zero_stage"):
        raise LayoutError(f"layout {key}={value!r} must be a positive integer")
      values[field] = int(value)
    elif field in ("sequence_parallel", "pipeline_recompute"):
      if value.lower() not in ("0", "1", "true", "false"):
        raise LayoutError(f"layout {key}={value!r} must be 0 or 1")
      values[field] = value.lower() in ("1", "true")
    elif field == "stage_layers":
      stage_split.parse(value)
      values[field] = value
    elif field in ("remat", "pipeline_schedule", "vocab_over_fsdp", "context_impl"):
      allowed = {"remat": REMATS, "pipeline_schedule": schedules.SCHEDULES,
                 "vocab_over_fsdp": ("auto", "on", "off"), "context_impl": CONTEXT_IMPLS}[field]
      if value not in allowed:
        raise LayoutError(f"layout {key}={value!r} is not one of {', '.join(allowed)}")
      values[field] = value
    else:
      raise LayoutError(f"unknown layout key {key!r}; keys: {', '.join(_INTS)}, remat,"
                        " sequence_parallel (sp), pipeline_schedule (schedule), vocab_over_fsdp,"
                        " stage_layers, pipeline_recompute, context_impl (cp_impl);"
                        f" aliases {', '.join(ALIASES)}")
  layout = Layout(**values)
  check_switches(layout)
  return layout


def check_switches(layout: Layout) -> None:
  """One-line LayoutError for switches that contradict each other or the sizes."""
  if layout.zero_stage not in (0, 1, 2, 3):
    raise LayoutError(f"zero stage {layout.zero_stage} must be 0, 1, 2 or 3")
  if layout.sequence_parallel and layout.tensor == 1:
    raise LayoutError("sequence parallelism needs tensor > 1 (it splits the sequence over"
                      " tensor): set tensor to more than 1 or turn sequence_parallel off")
  if layout.pipeline_schedule in schedules.V_SHAPED and layout.virtual_stages != 2:
    raise LayoutError(f"schedule {layout.pipeline_schedule} runs two chunks per stage (its V):"
                      " set virtual_stages=2 (vpp=2)")
  if layout.virtual_stages > 1 and layout.pipeline_schedule not in schedules.INTERLEAVING:
    raise LayoutError(f"virtual_stages={layout.virtual_stages} needs the interleaved_1f1b or"
                      " paired_1f1b pipeline schedule")
