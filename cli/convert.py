"""`meshtron convert`: Hugging Face directories ⇄ meshtron checkpoints (parameters only)."""

import dataclasses
import json
import os
import shutil

import jax
import orbax.checkpoint as ocp
from absl import logging

import sharding
from cli import flags
from models import abstract_model, hf, param_names
from models.config import ModelConfig
from sharding.pipeline import stage_split
from trainer.checkpoint import ITEMS, CheckpointError
from trainer.config import TrainConfig, config_from_dict
from trainer.hf_init import PREFIX


def _local_layout(model: ModelConfig):
  """(abstract params, their NamedShardings): FSDP over this process's devices (bounding
  per-device memory during a conversion), or one device when a dim does not divide."""
  _, abstract = abstract_model(model)
  for devices in (jax.local_devices(), jax.local_devices()[:1]):
    mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=-1), devices)
    with sharding.use_rules(mesh):
      try:
        return abstract, sharding.tree_shardings(param_names(model), abstract, "params")
      except sharding.LayoutError:  # a dim that does not divide: fall back to one device
        continue


def from_hf(model_dir: str, out: str) -> None:
  """HF directory -> OUT/params (orbax, parameters only), OUT/config.json (our model config and
  the HF one), and OUT/tokenizer.json when the directory has one."""
  if os.path.exists(os.path.join(out, "params")):
    raise ValueError(f"{out}/params already exists; convert into a new directory")
  model = hf.read_config(model_dir)
  hf_config = hf.read_hf_config(model_dir)
  _, shardings = _local_layout(model)
  params = hf.load_params(model_dir, model, shardings)
  os.makedirs(out, exist_ok=True)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.abspath(os.path.join(out, "params")), params)
  with open(os.path.join(out, "config.json"), "w", encoding="utf-8") as f:
    json.dump({"model": dataclasses.asdict(model), "hf_config": hf_config, "source": model_dir},
              f, indent=2)
  if hf.tokenizer_file(model_dir):
    shutil.copy(hf.tokenizer_file(model_dir), os.path.join(out, "tokenizer.json"))
  print(f"wrote {out}: {model.num_params() / 1e6:.2f}M parameters from {model_dir}")


def _restore_params(path: str, model: ModelConfig, partial: bool, written=()):
  """Restores only the parameters (never the optimizer state) into the local FSDP layout; a
  layer stacks `written` padded for uneven pipeline stages come back as the model's."""
  abstract, shardings = _local_layout(model)
  target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        abstract, shardings)
  if written:
    target = stage_split.stored_like(target, written, ())
  if partial:  # a train state: take its `params` subtree
    target = {"params": target}
  restore_args = jax.tree.map(lambda a: ocp.ArrayRestoreArgs(sharding=a.sharding), target)
  try:
    with ocp.PyTreeCheckpointer() as checkpointer:
      out = checkpointer.restore(path, args=ocp.args.PyTreeRestore(
          target, restore_args=restore_args, partial_restore=partial))
  except Exception as e:  # orbax raises many types for unreadable or mismatched checkpoints
    raise CheckpointError(f"could not read the parameters in {path}"
                          f" ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None
  out = out["params"] if partial else out
  return stage_split.restack(out, written, ()) if written else out


def _source(src: str):
  """(model config, params, base HF config, tokenizer.json or None) of a `--from=hf` output or a
  training workdir (its latest committed checkpoint)."""
  config_path = os.path.join(src, "config.json")
  if not os.path.isfile(config_path):
    raise ValueError(f"{config_path} not found: --workdir must be a training workdir or a"
                     " `meshtron convert --from=hf` output")
  with open(config_path, encoding="utf-8") as f:
    saved = json.load(f)
  if os.path.isdir(os.path.join(src, "params")):
    model = config_from_dict(ModelConfig, saved["model"])
    params = _restore_params(os.path.abspath(os.path.join(src, "params")), model, partial=False)
    tokenizer = os.path.join(src, "tokenizer.json")
    return model, params, saved.get("hf_config"), tokenizer if os.path.isfile(tokenizer) else None
  cfg = config_from_dict(TrainConfig, saved)
  directory = os.path.abspath(os.path.join(src, "checkpoints"))
  step = None
  if os.path.isdir(directory):  # read-only: an export never touches the run's checkpoints
    manager = ocp.CheckpointManager(directory, item_names=ITEMS,
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    step = manager.latest_step()
    manager.close()
  if step is None:
    raise CheckpointError(f"no committed checkpoint in {directory}")
  with open(os.path.join(directory, str(step), "meta", "metadata"), encoding="utf-8") as f:
    written = stage_split.from_meta(json.load(f).get("stage_layers"))
  params = _restore_params(os.path.join(directory, str(step), "state"), cfg.model, partial=True,
                           written=written)
  base = None
  if cfg.init_from.startswith(PREFIX):  # keep the original's token ids and context length
    try:
      base = hf.read_hf_config(cfg.init_from[len(PREFIX):])
    except ValueError:
      logging.warning("%s is gone: writing a config.json without its extra fields",
                      cfg.init_from)
  tokenizer = None if cfg.data.tokenizer == "byte" else cfg.data.tokenizer
  logging.info("exporting step %d of %s", step, src)
  return cfg.model, params, base, tokenizer


def to_hf(src: str, out: str) -> None:
  """A training workdir (latest checkpoint) or a `--from=hf` output -> a HF directory."""
  model, params, base, tokenizer = _source(src)
  files = hf.save_params(params, model, out, base_config=base)
  if tokenizer:
    shutil.copy(tokenizer, os.path.join(out, "tokenizer.json"))
    files.append("tokenizer.json")
  print(f"wrote {out}: {', '.join(files)}")
  if model.mtp_depth:  # models/hf maps the main model only; its logits never use the modules
    print(f"left out the {model.mtp_depth} multi-token prediction module(s): the Hugging Face"
          " formats here have no place for them")


def run(direction_from: str, direction_to: str, model_dir: str, out: str, workdir: str,
        overwrite: bool = False) -> None:
  """The `convert` verb: exactly one of --from=hf (with --model_dir) or --to=hf (with --workdir),
  and --out, which must be empty or new unless `overwrite`."""
  if not out:
    raise ValueError("convert needs --out")
  if os.path.isdir(out) and os.listdir(out) and not overwrite:
    raise ValueError(f"--out={out} is not empty (it holds {', '.join(sorted(os.listdir(out))[:4])}"
                     f"{', ...' if len(os.listdir(out)) > 4 else ''}); convert into a new"
                     " directory, or add --overwrite to replace what is there")
  if os.path.exists(out) and not os.path.isdir(out):
    raise ValueError(f"--out={out} is a file; convert into a directory")
  if model_dir and not os.path.isfile(os.path.join(model_dir, "config.json")):
    raise ValueError(f"--model_dir={model_dir} holds no config.json (a Hugging Face model"
                     " directory)")
  if direction_from == "hf" and not direction_to:
    if not model_dir:
      raise ValueError("convert --from=hf needs --model_dir=<dir with config.json + safetensors>")
    return from_hf(model_dir, out)
  if direction_to == "hf" and not direction_from:
    return to_hf(workdir, out)
  raise ValueError("convert takes --from=hf --model_dir=DIR --out=CKPT, or --to=hf"
                   " --workdir=WORKDIR --out=DIR")


def run_flags(config: TrainConfig) -> None:
  """The verb as the command line gives it (the config is not used: the directories say all)."""
  del config
  run(flags.FROM.value, flags.TO.value, flags.MODEL_DIR.value, flags.OUT.value,
      flags.WORKDIR.value, flags.OVERWRITE.value)
