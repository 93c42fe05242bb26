"""`meshtron compile`: the train step compiled ahead of time for --target (this machine, or a
described GPU cluster with no GPU present: trainer/aot.py), reported as a table or JSON; with
--timeline, the schedule XLA chose where the step's collectives are (sharding/xla/overlap.py)."""

import dataclasses
import json
import os
import sys
import tempfile

from cli import flags
from sharding.xla import compiled, overlap
from trainer.aot import compile_report
from trainer.config import TrainConfig
from trainer.hf_init import resolve_init_from


def run(config: TrainConfig) -> None:
  with tempfile.TemporaryDirectory() as tmp:
    hlo = flags.HLO.value or (os.path.join(tmp, "step.hlo") if flags.TIMELINE.value else "")
    rep, device_memory = compile_report(resolve_init_from(config), flags.TARGET.value, hlo)
    print(json.dumps(dataclasses.asdict(rep)) if flags.JSON.value
          else compiled.format_report(rep, device_memory))
    if device_memory and not compiled.fits(rep, device_memory)[0]:  # also for --json readers
      print(f"meshtron: warning: this step does not fit {rep.target}: its peak is"
            f" {rep.memory['peak'] / compiled.GIB:,.1f} GiB per device, the device has"
            f" {device_memory / compiled.GIB:,.1f} GiB; `meshtron plan` lists layouts that fit",
            file=sys.stderr)
    if flags.TIMELINE.value and not flags.JSON.value:
      with open(hlo) as f:
        text = f.read()
      computation = overlap.busiest_computation(text)
      print(f"schedule of {computation} (collectives and matmul kernels; other kernels folded):")
      print("\n".join(overlap.timeline(text, computation, width=99)))
