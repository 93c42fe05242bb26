"""Hugging Face checkpoints: config.json and safetensors streamed into shardings and back out.

Owns the file side: reading and writing safetensors (`SafetensorsFiles`, `save_params`), config.json
and the public API (read_config, load_params, from_pretrained, save_pretrained). What tensors an
architecture has and how they map to ours comes from registry.py.
"""

import itertools
import json
import os
import struct

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from models.builder import abstract_model
from models.config import ModelConfig
from models.hf.registry import architecture_of, config_from_hf, config_to_hf, entries
from models.hf.layouts import Entry

# safetensors dtype codes. Reads use the documented file layout (8-byte header size, JSON header,
# raw little-endian data) through np.memmap: the `safetensors` numpy API cannot return bfloat16,
# the dtype of most HF checkpoints, and a memmap reads only the bytes a device's slice touches.
_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
           "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
INDEX = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 2 * 2**30
# Tensors some HF checkpoints carry that hold no parameter (recomputed buffers).
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def read_hf_config(model_dir: str) -> dict:
  """The config.json of a HF model directory; one-line ValueError when missing or unreadable."""
  path = os.path.join(model_dir, "config.json")
  if not os.path.isfile(path):
    raise ValueError(f"{path} not found: a Hugging Face model directory needs config.json")
  try:
    with open(path, encoding="utf-8") as f:
      return json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f"{path} is not valid JSON ({e})") from None


def read_config(model_dir: str, dtype: str = "float32") -> ModelConfig:
  """Our ModelConfig from `model_dir/config.json` (params and compute in `dtype`)."""
  hf_config = read_hf_config(model_dir)
  path = os.path.join(model_dir, "config.json")
  try:
    return config_from_hf(hf_config, dtype)
  except KeyError as e:
    raise ValueError(f"{path} lacks {e.args[0]!r}") from None
  except ValueError as e:
    raise ValueError(f"{path}: {e}") from None


def tokenizer_file(model_dir: str) -> str | None:
  """`model_dir/tokenizer.json` when the directory has one."""
  path = os.path.join(model_dir, "tokenizer.json")
  return path if os.path.isfile(path) else None


class SafetensorsFiles:
  """The tensors of a directory's safetensors files, by name, opened lazily as memmaps."""

  def __init__(self, model_dir: str):
    index = os.path.join(model_dir, INDEX)
    if os.path.isfile(index):
      with open(index, encoding="utf-8") as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    else:
      files = sorted(n for n in os.listdir(model_dir) if n.endswith(".safetensors"))
    if not files:
      raise ValueError(f"no *.safetensors files in {model_dir}")
    self.where = {}  # name -> (path, dtype code, shape, absolute byte offset)
    for name in files:
      path = os.path.join(model_dir, name)
      if not os.path.isfile(path):
        raise ValueError(f"{index} lists {name}, which does not exist")
      with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
      header.pop("__metadata__", None)
      for tensor, info in header.items():
        self.where[tensor] = (path, info["dtype"], tuple(info["shape"]),
                              8 + size + info["data_offsets"][0])

  def shape(self, name: str) -> tuple[int, ...]:
    return self.where[name][2]

  def array(self, name: str) -> np.ndarray:
    """A read-only memmap of one tensor: nothing is read until it is sliced."""
    path, code, shape, offset = self.where[name]
    if code not in _DTYPES:
      raise ValueError(f"tensor {name} in {path} has dtype {code}, not a float type")
    return np.memmap(path, dtype=_DTYPES[code], mode="r", offset=offset, shape=shape)

  def check(self, expected: dict[str, tuple[int, ...]], model_dir: str,
            ignored_layers_from: int | None = None) -> None:
    """Every expected tensor present with its shape, and nothing unaccounted for but the layers
    numbered from `ignored_layers_from` on (DeepSeek-V3's multi-token-prediction modules, which
    transformers ignores too)."""
    missing = [n for n in expected if n not in self.where]
    if missing:
      raise ValueError(f"{model_dir} is missing {len(missing)} tensor(s) the config needs:"
                       f" {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    for name, shape in expected.items():
      if self.shape(name) != shape:
        raise ValueError(f"tensor {name} has shape {list(self.shape(name))} in"
                         f" {self.where[name][0]} but config.json implies {list(shape)}")
    def ignored(name):
      parts = name.split(".")
      return (ignored_layers_from is not None and name.startswith("model.layers.")
              and int(parts[2]) >= ignored_layers_from)
    extra = [n for n in self.where if n not in expected and not ignored(n)
             and not n.endswith(IGNORED_SUFFIXES) and n != "lm_head.weight"]
    if extra:
      raise ValueError(f"{model_dir} has {len(extra)} tensor(s) this architecture does not use:"
                       f" {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")


def _get(tree: dict, path):
  for key in path:
    tree = tree[key]
  return tree


def _set(tree: dict, path, value) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def _slices(index, shape) -> tuple[slice, ...]:
  return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def _place(tensors: SafetensorsFiles, entry: Entry, leaf, sharding,
           layer_of_row=None) -> jax.Array:
  """One parameter, built device slice by device slice from its HF tensor(s).

  Each addressable device's callback reads, for every (layer[, expert]) in its slice, only the
  HF rows and columns that slice covers (from the memmap); devices with the same slice share it.
  `layer_of_row`: a padded layer stack's model layer per row, -1 for padding (zeros).
  """
  lead, inner = leaf.shape[:entry.stacked], leaf.shape[entry.stacked:]
  if layer_of_row is not None:  # names of the model's layers, not of the padded rows
    lead = (int(max(layer_of_row)) + 1, *lead[1:])
  names = dict(entry.hf_names(lead))
  cache = {}  # distinct slices only: replicated devices share one host copy

  def callback(index):
    index = _slices(index, leaf.shape)
    key = tuple((s.start, s.stop) for s in index)
    if key not in cache:
      # One allocation for the device's slice, filled one HF tensor slice at a time (converted to
      # the parameter dtype on the way) to keep transient copies to a single HF tensor.
      out = np.empty(tuple(s.stop - s.start for s in index), leaf.dtype)
      ranges = [range(s.start, s.stop) for s in index[:entry.stacked]]
      for idx in itertools.product(*ranges):
        local = tuple(i - s.start for i, s in zip(idx, index))
        if layer_of_row is not None:
          if layer_of_row[idx[0]] < 0:
            out[local] = 0
            continue
          idx = (int(layer_of_row[idx[0]]), *idx[1:])
        out[local] = entry.layout.read(tensors.array(names[idx]), index[entry.stacked:], inner)
      cache[key] = out
    return cache[key]

  return jax.make_array_from_callback(leaf.shape, sharding, callback)


def load_params(model_dir: str, cfg: ModelConfig, shardings=None, layer_of_row=None,
                compute=None) -> dict:
  """Our parameters (pure dict) from a HF directory's safetensors, streamed into `shardings`.

  Args:
    model_dir: holds config.json and model.safetensors or model-*.safetensors + the index.
    cfg: the architecture (`read_config(model_dir)`, possibly with other dtypes).
    shardings: a pytree of jax.sharding.Sharding matching the params; None = the first device.
    layer_of_row: {stack: for each stored row, its layer in the stack, -1 for a padding row
      (zeros)} for the layer stacks stored padded (uneven pipeline stages); others as they are.
    compute: the run's ComputeConfig, whose scan_layers decides the stacks' form (None: stacked).

  Host memory: parameters are placed one at a time, each from its local devices' distinct slices,
  filled one HF tensor slice at a time from memmaps of the files (only the bytes a slice covers
  are read). The runtime may hold a previous parameter's host buffer until a later transfer, so
  the peak is a small multiple of the largest parameter's local slices, never the whole model
  (measured: 385 MiB of host arrays to load a 714 MiB model whose largest weight is 128 MiB).
  """
  tensors = SafetensorsFiles(model_dir)
  _, abstract = abstract_model(cfg, compute)
  rows = entries(abstract, cfg)
  expected = {}
  for entry in rows:
    leaf = _get(abstract, entry.path)
    hf_shape = entry.layout.hf_shape(leaf.shape[entry.stacked:])
    expected.update({name: hf_shape for _, name in entry.hf_names(leaf.shape[:entry.stacked])})
  tensors.check(expected, model_dir, architecture_of(cfg).unmapped_layers_from(cfg))
  if shardings is None:
    device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shardings = jax.tree.map(lambda _: device, abstract)
  params = {}
  for entry in rows:
    leaf, rows_map = _get(abstract, entry.path), None
    if layer_of_row and entry.path[0] in layer_of_row:
      rows_map = layer_of_row[entry.path[0]]
      leaf = jax.ShapeDtypeStruct((len(rows_map), *leaf.shape[1:]), leaf.dtype)
    _set(params, entry.path, _place(tensors, entry, leaf, _get(shardings, entry.path), rows_map))
  return params


def from_pretrained(model_dir: str, dtype: str = "float32", shardings=None):
  """A meshtron Transformer with a HF directory's weights; `model(tokens_BL)` gives logits.

  Args:
    model_dir: a HF model directory (config.json + *.safetensors).
    dtype: parameter and compute dtype.
    shardings: optional pytree of Shardings matching the params (see `load_params`).
  """
  cfg = read_config(model_dir, dtype)
  graphdef, _ = abstract_model(cfg)
  return nnx.merge(graphdef, load_params(model_dir, cfg, shardings))


def save_params(params: dict, cfg: ModelConfig, out_dir: str, *, base_config: dict | None = None,
                max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
  """Writes config.json and safetensors that `transformers` loads; returns the files written.

  Tensors are fetched one HF tensor (one layer's slice) at a time and written in files of at most
  `max_shard_bytes` (more than one: `model-0000i-of-0000n.safetensors` + the index), so host
  memory holds one file's worth. Parameters must be addressable by this process.
  """
  from safetensors.numpy import save_file
  config_to_hf(cfg)  # refuses a MoE no HF format here holds, before writing
  os.makedirs(out_dir, exist_ok=True)
  if any(n.endswith(".safetensors") or n == INDEX for n in os.listdir(out_dir)):
    raise ValueError(f"{out_dir} already holds safetensors files; export into an empty directory")
  pending, size, total, parts, weight_map = {}, 0, 0, [], {}

  def flush():
    nonlocal pending, size
    path = os.path.join(out_dir, f"part-{len(parts):05d}.tmp")
    save_file(pending, path, metadata={"format": "pt"})
    parts.append((path, list(pending)))
    pending, size = {}, 0

  for entry in entries(params, cfg):
    array = _get(params, entry.path)
    if not array.is_fully_addressable:
      raise ValueError("export needs every parameter addressable by one process; run the"
                       " conversion as a single process")
    for idx, name in entry.hf_names(array.shape[:entry.stacked]):
      tensor = np.ascontiguousarray(entry.layout.to_hf(np.asarray(array[idx])))
      if pending and size + tensor.nbytes > max_shard_bytes:
        flush()
      pending[name] = tensor
      size += tensor.nbytes
      total += tensor.nbytes
  flush()
  files = []
  for i, (path, names) in enumerate(parts):
    final = ("model.safetensors" if len(parts) == 1
             else f"model-{i + 1:05d}-of-{len(parts):05d}.safetensors")
    os.replace(path, os.path.join(out_dir, final))
    weight_map.update({n: final for n in names})
    files.append(final)
  if len(parts) > 1:
    with open(os.path.join(out_dir, INDEX), "w", encoding="utf-8") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    files.append(INDEX)
  with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
    json.dump(config_to_hf(cfg, base_config), f, indent=2, sort_keys=True)
  return files + ["config.json"]


def save_pretrained(model, out_dir: str, *, base_config: dict | None = None,
                    max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
  """Writes a meshtron Transformer as a HF LlamaForCausalLM directory (see `save_params`)."""
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  return save_params(params, model.config, out_dir, base_config=base_config,
                     max_shard_bytes=max_shard_bytes)
