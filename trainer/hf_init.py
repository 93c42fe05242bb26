"""Starting a run from Hugging Face weights (`init_from=hf:DIR`): the architecture and tokenizer
the directory sets (`resolve_init_from`, before the run is built) and the fresh train state whose
parameters are its weights, streamed into the run's shardings (`init_state_from_hf`)."""

import dataclasses

import jax
from absl import logging

from models import hf
from sharding.pipeline import stage_split
from trainer.config import TrainConfig
from trainer.state import TrainState, fresh_state
from trainer.tokenizer import ByteTokenizer

PREFIX = "hf:"
# ModelConfig fields that a HF config.json decides; the rest (dtypes, the embedding init) stay as
# the run configured them, and so does how the model is computed (TrainConfig.compute).
ARCHITECTURE_FIELDS = ("vocab_size", "embed_dim", "num_layers", "num_heads", "num_kv_heads",
                       "head_dim", "mlp_dim", "tie_embeddings", "norm_eps", "rope_theta",
                       "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
                       "rope_original_max_len")


def resolve_init_from(cfg: TrainConfig) -> TrainConfig:
  """With `init_from=hf:DIR`: the architecture from DIR/config.json, and DIR/tokenizer.json as the
  tokenizer when `data.tokenizer` is "byte". Without: `cfg` unchanged."""
  if not cfg.init_from.startswith(PREFIX):
    return cfg
  model_dir = cfg.init_from[len(PREFIX):]
  hf_model = hf.read_config(model_dir)
  arch = {k: getattr(hf_model, k) for k in ARCHITECTURE_FIELDS}
  changed = [f"{k}={getattr(cfg.model, k)}->{v}" for k, v in arch.items()
             if getattr(cfg.model, k) != v]
  if changed:
    logging.info("init_from %s sets model %s", cfg.init_from, ", ".join(changed))
  data = cfg.data
  tokenizer = hf.tokenizer_file(model_dir)
  if data.tokenizer == "byte" and tokenizer:
    logging.info("init_from %s: using its tokenizer %s", cfg.init_from, tokenizer)
    data = dataclasses.replace(data, tokenizer=tokenizer)
  elif data.tokenizer == "byte" and hf_model.vocab_size < ByteTokenizer.vocab_size:
    raise ValueError(f"{model_dir} has no tokenizer.json and its vocab_size"
                     f" {hf_model.vocab_size} is too small for the byte tokenizer"
                     f" ({ByteTokenizer.vocab_size}); set --config.data.tokenizer=<tokenizer.json>")
  return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **arch), data=data)


def init_state_from_hf(trainer) -> TrainState:
  """A fresh train state (step 0, new optimizer state) whose params are the HF weights of
  `init_from`, streamed straight into the trainer's parameter shardings."""
  cfg = trainer.cfg
  model_dir = cfg.init_from[len(PREFIX):]
  with trainer.scope():
    rows = {name: stage_split.layer_of_row(counts) for name, counts in trainer.stage_layers}
    params = hf.load_params(model_dir, cfg.model, trainer.shardings.params, rows, cfg.compute)
    state = jax.jit(lambda p: fresh_state(p, trainer.tx, cfg.seed),
                    out_shardings=trainer.shardings, donate_argnums=0)(params)
  logging.info("initialized the parameters from %s", model_dir)
  return state
