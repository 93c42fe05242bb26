"""Runs the tiny Llama's real train step (trainer.trainer.Trainer) under a layout, for comparisons."""

import dataclasses

import jax
import numpy as np

import sharding
from models import ComputeConfig, ModelConfig
from models.builder import stacked
from models.config import MoEConfig
from trainer.config import DataConfig, OptimConfig, TrainConfig
from trainer.trainer import Trainer
from trainer.state import make_init_fn, state_shardings, unstored
from trainer.step import make_grads_fn

# Every dim divides every mesh size up to 8: heads 16 / kv heads 8 (GQA), embed 32, mlp 64,
# vocab 264 = 8 x 33; batch 32 = 8 data-parallel devices x 4 microbatches; seq 16 = tensor 8 x 2
# for sequence parallelism.
MODEL = ModelConfig(vocab_size=264, embed_dim=32, num_layers=2, num_heads=16, num_kv_heads=8,
                    head_dim=8, mlp_dim=64)
# attention_impl "xla", what "auto" runs on CPU, named: the analytic estimates these programs are
# checked against then count the reference's [s, s] scores (the estimator takes "auto" as flash).
COMPUTE = ComputeConfig(attention_impl="xla")
BATCH, SEQ, STEPS = 32, 16, 3
OPTIM = OptimConfig(learning_rate=1e-2, warmup_steps=0, weight_decay=0.1)


@dataclasses.dataclass
class Result:
  losses: list[float]
  grads: list[np.ndarray]  # at the initial parameters
  initial_params: list[np.ndarray]
  params: list[np.ndarray]  # after STEPS optimizer steps
  metrics: list[dict] = dataclasses.field(default_factory=list)  # every metric, per step


def config(mesh_cfg: sharding.MeshConfig, *, microbatches: int = 1, remat: str = "none",
           model: ModelConfig = MODEL, moe: MoEConfig | None = None,
           compute: ComputeConfig = COMPUTE, sharding_rules: str = "") -> TrainConfig:
  """The harness run's config; `moe` turns the model into an MoE (tests/test_moe_parallel.py)."""
  cfg = TrainConfig(model=model, compute=dataclasses.replace(compute, remat=remat),
                    mesh=mesh_cfg, optim=OPTIM, data=DataConfig(source="synthetic"),
                    batch_size=BATCH, seq_len=SEQ, microbatches=microbatches, steps=STEPS,
                    sharding_rules=sharding_rules)
  if moe is not None:
    cfg.model = dataclasses.replace(cfg.model, moe=moe)
    # Pure expert parallelism keeps the dense weights whole on every device by design (they
    # are data-parallel over `expert`); the tiny model's experts are too small to outweigh them.
    cfg.max_replicated_fraction = 1.0
  return cfg


def batches(seed: int = 0) -> list[dict]:
  """STEPS packed batches: two documents per row, positions restarting, uneven loss masks."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(STEPS):
    tokens = rng.integers(0, MODEL.vocab_size, (BATCH, SEQ + 1)).astype(np.int32)
    cut = rng.integers(1, SEQ, BATCH)[:, None]
    position = np.arange(SEQ)[None]
    out.append({
        "inputs": tokens[:, :-1], "targets": tokens[:, 1:],
        "positions": np.where(position < cut, position, position - cut).astype(np.int32),
        "segment_ids": np.where(position < cut, 1, 2).astype(np.int32),
        "loss_mask": (rng.random((BATCH, SEQ)) < 0.9).astype(np.float32),
    })
  return out


def run(mesh_cfg: sharding.MeshConfig, *, devices=None, **kw) -> Result:
  """Loss per step, initial gradients and final params of STEPS AdamW steps under a layout."""
  cfg = config(mesh_cfg, **kw)
  trainer = Trainer(cfg, devices)
  trainer.init_state()
  grads_fn = make_grads_fn(trainer.step_graphdef, trainer.names, trainer.layout,
                           trainer.step_config)
  # Uneven pipeline stages store the layer stack padded: compare the model's own rows.
  # In the stacked form, whichever the run stores (compute.scan_layers), to compare runs.
  leaves = lambda params: [np.asarray(p) for p in
                           jax.tree.leaves(stacked(unstored(params, trainer.stage_layers)))]
  with trainer.scope():
    # One compile for the step and the gradients it applies (XLA shares the computation).
    step_and_grads = jax.jit(lambda state, batch: (*trainer.step_fn(state, batch),
                                                   grads_fn(state.params, batch)[0]),
                             in_shardings=(trainer.shardings, trainer.batch_sharding),
                             out_shardings=(trainer.shardings, sharding.replicated(), None))
    state, losses, grads, steps = trainer.state, [], None, []
    initial = leaves(state.params)
    for batch in batches():
      state, metrics, step_grads = step_and_grads(state, trainer.to_device(batch))
      grads = grads or leaves(step_grads)
      losses.append(float(metrics["loss"]))
      steps.append({k: float(v) for k, v in metrics.items()})
  return Result(losses, grads, initial, leaves(state.params), steps)


def compile_step(mesh_cfg: sharding.MeshConfig, **kw):
  """The compiled train step of a layout from abstract inputs (nothing allocated or run)."""
  trainer = Trainer(config(mesh_cfg, **kw))
  with trainer.scope():
    return trainer.train_step.lower(trainer.abstract_state, trainer.abstract_batch()).compile()


def sharded_state(model_cfg: ModelConfig, tx, names, seed: int = 0,
                  compute: ComputeConfig | None = None):
  """(train state initialized directly into its shardings, the shardings) in the current sharding
  scope, as a Trainer does, for tests that drive the step functions themselves; `compute`
  decides the fp8 state among the parameters."""
  init = make_init_fn(model_cfg, tx, seed, compute=compute)
  shardings = state_shardings(jax.eval_shape(init), names, tx)
  return jax.jit(init, out_shardings=shardings)(), shardings
