"""`meshtron train`: a config trained in --workdir (rerunning resumes), or with --dry_run the
sharding of every parameter and activation, the layout checked, nothing trained."""

from cli import flags
from trainer import loop
from trainer.config import TrainConfig
from trainer.hf_init import resolve_init_from
from trainer.trainer import Trainer


def run(config: TrainConfig) -> None:
  config = resolve_init_from(config)
  if flags.DRY_RUN.value:
    print(Trainer(config).sharding_report())
  else:
    loop.run(config, flags.WORKDIR.value)
