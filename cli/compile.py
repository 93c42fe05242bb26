"""`meshtron compile`: the train step compiled ahead of time for --target (this machine, or a
described GPU cluster with no GPU present: trainer/aot.py), reported as a table or JSON."""

import dataclasses
import json

from cli import flags
from sharding.xla import compiled
from trainer.aot import compile_report
from trainer.config import TrainConfig
from trainer.hf_init import resolve_init_from


def run(config: TrainConfig) -> None:
  rep, device_memory = compile_report(resolve_init_from(config), flags.TARGET.value,
                                      flags.HLO.value)
  print(json.dumps(dataclasses.asdict(rep)) if flags.JSON.value
        else compiled.format_report(rep, device_memory))
