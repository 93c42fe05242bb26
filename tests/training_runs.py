"""Short training runs of a small Llama on the standard-library corpus, for comparing precisions
and optimizers by their loss curves. Runs are cached per process: tests share them."""

import dataclasses
import functools

import jax

from configs import llama
from models.fp8.config import Fp8Config
from trainer.trainer import Trainer


def config(steps: int, *, dtype: str = "float32", fp8: bool = False, optimizer: str = "adamw",
           recipe: str = "delayed", mlp_dim: int = 192, xla_options: str = ""):
  """The tiny Llama of tests/test_train.py (2 layers, d 64) on one device, batch 16 x 64; fp8
  with `recipe` (blockwise needs an mlp_dim of at most 128 or a multiple of 128); `xla_options`
  as TrainConfig.xla_options."""
  cfg = llama.debug()
  cfg.model.num_layers, cfg.model.embed_dim, cfg.model.mlp_dim = 2, 64, mlp_dim
  cfg.model.dtype = dtype
  cfg.compute.fp8 = Fp8Config(enabled=fp8, recipe=recipe)
  cfg.optim = dataclasses.replace(cfg.optim, name=optimizer)
  cfg.steps, cfg.batch_size, cfg.seq_len = steps, 16, 64
  cfg.xla_options = xla_options
  return cfg


@functools.lru_cache(maxsize=None)
def losses(steps: int, **kw) -> tuple[float, ...]:
  """The training loss of every step (same data order and init for every variant)."""
  trainer = Trainer(config(steps, **kw), jax.devices()[:1])
  trainer.init_state()
  batches = trainer.iterator("train")
  out = []
  with trainer.scope():
    for _ in range(steps):
      trainer.state, metrics = trainer.train_step(trainer.state, trainer.to_device(next(batches)))
      out.append(metrics["loss"])
  return tuple(float(x) for x in jax.device_get(out))


def mean(values, start: int, stop: int) -> float:
  return sum(values[start:stop]) / (stop - start)
