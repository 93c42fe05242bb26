"""The input pipeline: documents from a source, tokenized, packed into windows, batched by grain."""

import dataclasses
import functools
import glob
import json
import os
import sys
import sysconfig

import grain
import numpy as np
import pyarrow.parquet as pq

from trainer.config import TrainConfig

_EXTENSIONS = (".txt", ".jsonl", ".parquet")
_STDLIB_SKIP = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib",
                          "__pycache__"})
# Knuth's multiplicative hash: consecutive indices spread evenly over the buckets, so any
# contiguous run of 10_000 documents holds out exactly eval_fraction of them.
_HASH_MULTIPLIER = 2654435761
_HASH_BUCKETS = 10_000
_SPLITS = {"train": 0, "eval": 1}  # value: the synthetic random stream


@dataclasses.dataclass(frozen=True)
class _File:
  """One file of the source and where its documents are."""

  path: str
  kind: str  # "txt" (whole file is one document), "jsonl" (one per line), "parquet" (one per row)
  count: int
  offsets: np.ndarray | None = None  # jsonl: byte offset of each non-blank line
  line_numbers: np.ndarray | None = None  # jsonl: 1-based line number of each non-blank line


class _Documents:
  """Every document of a source under one global index; the text is read only on demand."""

  def __init__(self, name: str, files: list[_File], text_field: str):
    self.name = name
    self.files = files
    self.text_field = text_field
    self.num_bytes = sum(os.path.getsize(f.path) for f in files)
    self._starts = np.cumsum([0] + [f.count for f in files])

  def __len__(self) -> int:
    return int(self._starts[-1])

  def starts(self) -> np.ndarray:
    """The index of each file's first document (files without documents left out)."""
    return np.unique(self._starts[:-1][np.asarray([f.count for f in self.files]) > 0])

  def file_of(self, index: int) -> str:
    return self.files[int(np.searchsorted(self._starts, index, side="right")) - 1].path

  def read(self, index: int) -> str:
    """Returns the text of document `index`; malformed data is a one-line ValueError."""
    file_index = int(np.searchsorted(self._starts, index, side="right")) - 1
    file = self.files[file_index]
    local = index - int(self._starts[file_index])
    if file.kind == "txt":
      with open(file.path, "rb") as f:
        return f.read().decode("utf-8", errors="replace")
    if file.kind == "jsonl":
      return _read_jsonl_line(file, local, self.text_field)
    value = _parquet_column(file.path, self.text_field)[local].as_py()
    return "" if value is None else str(value)


def _read_jsonl_line(file: _File, local: int, field: str) -> str:
  line_number = int(file.line_numbers[local])
  with open(file.path, "rb") as f:
    f.seek(int(file.offsets[local]))
    line = f.readline()
  try:
    record = json.loads(line)
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    reason = e.msg if isinstance(e, json.JSONDecodeError) else "invalid UTF-8"
    raise ValueError(f"{file.path} line {line_number}: malformed JSON ({reason})") from None
  if not isinstance(record, dict) or field not in record:
    raise ValueError(f"{file.path} line {line_number}: no {field!r} field"
                     " (set data.text_field to the field holding the text)")
  if not isinstance(record[field], str):
    raise ValueError(f"{file.path} line {line_number}: field {field!r} is a"
                     f" {type(record[field]).__name__}, expected a string")
  return record[field]


@functools.lru_cache(maxsize=None)
def _parquet_column(path: str, field: str):
  # Parquet has no cheap random row access and shuffled reads hop between files, so each file's
  # text column is decoded once and kept (as Arrow buffers, about the size of the text).
  return pq.read_table(path, columns=[field]).column(field)


def _index_file(path: str, text_field: str) -> _File:
  """Counts the documents of one file (and finds the lines of a .jsonl) without decoding them."""
  ext = os.path.splitext(path)[1].lower()
  if ext == ".txt":  # one document, unless the file is empty
    return _File(path, "txt", int(os.path.getsize(path) > 0))
  if ext == ".jsonl":
    offsets, line_numbers, offset = [], [], 0
    with open(path, "rb") as f:
      for line_number, line in enumerate(f, 1):
        if line.strip():
          offsets.append(offset)
          line_numbers.append(line_number)
        offset += len(line)
    return _File(path, "jsonl", len(offsets), np.asarray(offsets, np.int64),
                 np.asarray(line_numbers, np.int64))
  if ext == ".parquet":
    try:
      metadata = pq.ParquetFile(path).metadata
    except Exception as e:  # pyarrow raises ArrowInvalid / OSError for non-parquet files
      raise ValueError(f"{path}: not a readable parquet file ({e})") from None
    columns = metadata.schema.to_arrow_schema().names
    if text_field not in columns:
      raise ValueError(f"{path}: no column {text_field!r} (columns: {', '.join(columns)};"
                       " set data.text_field)")
    return _File(path, "parquet", metadata.num_rows)
  raise ValueError(f"{path}: unsupported extension {ext!r} (expected one of"
                   f" {', '.join(_EXTENSIONS)})")


def _walk(root: str, suffixes: tuple[str, ...], skip: frozenset[str] = frozenset()) -> list[str]:
  paths = []
  for directory, subdirectories, names in os.walk(root):
    subdirectories[:] = [d for d in subdirectories if d not in skip]
    paths += [os.path.join(directory, n) for n in names if n.lower().endswith(suffixes)]
  return sorted(paths)


def _list_files(source: str) -> list[str]:
  """Resolves a file, directory or glob to a sorted list of data files."""
  path = os.path.expanduser(source)
  if any(c in path for c in "*?["):
    paths = []
    for match in sorted(glob.glob(path, recursive=True)):
      paths += _walk(match, _EXTENSIONS) if os.path.isdir(match) else [match]
    paths = sorted(p for p in paths if p.lower().endswith(_EXTENSIONS))
    what = f"files matching {source!r}"
  elif os.path.isdir(path):
    paths, what = _walk(path, _EXTENSIONS), f"files under directory {source!r}"
  elif os.path.isfile(path):
    return [path]
  else:
    raise ValueError(f"data.source={source!r} is not 'stdlib', 'synthetic' or an existing"
                     " file, directory or glob")
  if not paths:
    raise ValueError(f"data.source: no {', '.join(_EXTENSIONS)} {what}")
  return paths


@functools.lru_cache(maxsize=16)
def _documents(source: str, text_field: str) -> _Documents:
  """Indexes a source once per process (describe_source and every iterator share it)."""
  if source == "stdlib":
    root = sysconfig.get_paths()["stdlib"]
    paths = _walk(root, (".py",), _STDLIB_SKIP)
    if not paths:
      raise ValueError(f"data.source='stdlib': no .py files found under {root}")
    return _Documents("stdlib", [_File(p, "txt", 1) for p in paths], text_field)
  documents = _Documents(source, [_index_file(p, text_field) for p in _list_files(source)],
                         text_field)
  if not len(documents):
    raise ValueError(f"data.source={source!r}: the files hold no documents (empty files and blank"
                     " lines hold none)")
  return documents


def _split_indices(num_documents: int, eval_fraction: float, split: str) -> np.ndarray:
  """Document indices of `split`, chosen by a fixed hash of the index so they never move."""
  buckets = (np.arange(num_documents, dtype=np.uint64) * np.uint64(_HASH_MULTIPLIER)
             % np.uint64(_HASH_BUCKETS))
  is_eval = buckets < eval_fraction * _HASH_BUCKETS
  if eval_fraction > 0:
    if num_documents < 2:
      raise ValueError(f"the source has {num_documents} document(s); holding out eval documents"
                       " needs at least 2 (or set data.eval_fraction=0)")
    if not is_eval.any():
      is_eval[np.argmin(buckets)] = True
    if is_eval.all():
      is_eval[np.argmax(buckets)] = False
  return np.flatnonzero(is_eval if split == "eval" else ~is_eval)


class _Tokenize:
  """Document index -> list of token pieces (runs in grain's read threads)."""

  def __init__(self, documents: _Documents, tokenizer, max_document_tokens: int):
    self._documents = documents
    self._tokenizer = tokenizer
    self._max = max_document_tokens

  def __call__(self, index) -> list[dict[str, np.ndarray]]:
    ids = self._tokenizer.encode(self._documents.read(int(index)))
    bos, eos = self._tokenizer.bos_id, self._tokenizer.eos_id
    head = np.asarray([] if bos is None else [bos], np.int32)
    tail = np.asarray([] if eos is None else [eos], np.int32)
    tokens = np.concatenate([head, ids, tail])
    step = self._max if self._max > 0 else max(len(tokens), 1)
    # Empty documents are dropped here: a zero-length piece would still take a segment id.
    return [{"tokens": tokens[i:i + step]} for i in range(0, len(tokens), step)]


class _Flatten(grain.experimental.FlatMapTransform):
  """Emits the pieces of each document one by one."""

  max_fan_out = 1 << 30  # only enforced for MapDatasets; documents may have many pieces

  def flat_map(self, element):
    return element


def _window_to_example(window: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """A packed window of seq_len + 1 tokens -> next-token inputs, targets and masks."""
  tokens = window["tokens"]
  segments = window["tokens_segment_ids"]
  return {
      "inputs": tokens[:-1],
      "targets": tokens[1:],
      # A document continued from the previous window restarts at 0: its start is not visible.
      "positions": window["tokens_positions"][:-1],
      "segment_ids": segments[:-1],
      "loss_mask": ((segments[:-1] == segments[1:]) & (segments[:-1] != 0)).astype(np.float32),
  }


class _SyntheticRow:
  """Row index -> one full-length document of uniform random tokens."""

  def __init__(self, seed: int, stream: int, vocab_size: int, seq_len: int):
    self._key = (seed, stream)
    self._vocab_size = vocab_size
    self._positions = np.arange(seq_len, dtype=np.int32)
    self._ones = np.ones(seq_len, np.int32)

  def __call__(self, row) -> dict[str, np.ndarray]:
    # Seeded by (seed, stream, row) so a row never depends on the rows read before it.
    rng = np.random.default_rng((*self._key, int(row)))
    tokens = rng.integers(0, self._vocab_size, len(self._positions) + 1, dtype=np.int32)
    return {"inputs": tokens[:-1], "targets": tokens[1:], "positions": self._positions,
            "segment_ids": self._ones, "loss_mask": self._ones.astype(np.float32)}


def _slices_as_tuples(state):
  if not isinstance(state, dict):
    return state
  return {key: ({feature: tuple(sl) for feature, sl in value.items()}
                if key == "remainder_slices" else _slices_as_tuples(value))
          for key, value in state.items()}


class _JsonSafeIterator(grain.DatasetIterator):
  """Passes batches through; restores states that went through JSON exactly.

  grain saves iterator states as JSON, which turns the packer's (-1, -1) "no remainder" tuple
  into a list that no longer compares equal, so a restored packer would emit a spurious empty
  segment; converting back to tuples avoids that.
  """

  def __next__(self):
    return next(self._parent)

  def get_state(self):
    return self._parent.get_state()

  def set_state(self, state):
    self._parent.set_state(_slices_as_tuples(state))


def make_iterator(config: TrainConfig, tokenizer, split: str, process_index: int = 0,
                  process_count: int = 1) -> grain.DatasetIterator:
  """Returns this process's infinite, checkpointable iterator of packed batches.

  Args:
    config: The run; uses `data`, `batch_size` (global) and `seq_len`.
    tokenizer: From `trainer.tokenizer.make_tokenizer`.
    split: "train" (shuffled, reshuffled each epoch) or "eval" (fixed order).
    process_index: This process's index.
    process_count: Number of processes sharing the global batch. By default every process
      reads the whole stream and keeps its block of rows of each global batch, so the batches
      (and checkpoints of the iterator) do not depend on the process count; with
      `data.shard_documents_by_process` each process reads only every `process_count`-th
      document instead (less host work at scale; the order then depends on the process count).

  Returns:
    A grain iterator (supporting `get_state` / `set_state`) of dicts with int32 `inputs`,
    `targets`, `positions`, `segment_ids` and float32 `loss_mask`, each of shape
    [batch_size // process_count, seq_len].

  Raises:
    ValueError: a bad split, batch size, process layout or source (one line saying what).
  """
  data = config.data
  if split not in _SPLITS:
    raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
  if split == "eval" and data.eval_fraction <= 0:
    raise ValueError(f"split='eval' needs data.eval_fraction > 0, got {data.eval_fraction}")
  if not 0 <= process_index < process_count:
    raise ValueError(f"process_index={process_index} is not in [0, {process_count})")
  if config.batch_size % process_count:
    raise ValueError(f"batch_size={config.batch_size} is not divisible by"
                     f" process_count={process_count}")
  rows_per_process = config.batch_size // process_count
  shard, shards = (process_index, process_count) if data.shard_documents_by_process else (0, 1)
  if data.source == "synthetic":
    rows = grain.MapDataset.range(shard, sys.maxsize, shards)
    ds = rows.map(_SyntheticRow(data.seed, _SPLITS[split], tokenizer.vocab_size,
                                config.seq_len))
    # Nothing is read: a row costs less than handing it to a thread (threads were ~10x slower).
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0))
  else:
    documents = _documents(data.source, data.text_field)
    indices = _split_indices(len(documents), data.eval_fraction, split)
    # Sharding the document list (not the repeated stream) keeps processes disjoint every epoch.
    mine = indices[shard::shards]
    if not len(mine):
      raise ValueError(f"process {process_index} of {process_count} gets none of the"
                       f" {len(indices)} {split} documents of {data.source!r}")
    ds = grain.MapDataset.source(mine)
    if split == "train":
      ds = ds.seed(data.seed).shuffle()  # grain folds the epoch into the seed: new order per epoch
    ds = ds.repeat(None).map(_Tokenize(documents, tokenizer, data.max_document_tokens))
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=data.num_threads))
    ds = grain.experimental.FlatMapIterDataset(ds, _Flatten())
    ds = grain.experimental.ConcatThenSplitIterDataset(
        ds, length_struct={"tokens": config.seq_len + 1})
    ds = ds.map(_window_to_example)
  ds = ds.batch(config.batch_size // shards, drop_remainder=True)
  if shards == 1 and process_count > 1:  # the global batch: keep this process's block of rows
    start = process_index * rows_per_process
    ds = ds.map(lambda batch: {k: v[start:start + rows_per_process] for k, v in batch.items()})
  return _JsonSafeIterator(iter(ds))


def check_source(config: TrainConfig, tokenizer, first: int = 8) -> None:
  """Reads the source's first documents (of up to `first` files) and both splits' sizes, so a
  missing, empty, binary or malformed source is one line before anything compiles; the rest is
  checked as it is read."""
  data = config.data
  if data.source == "synthetic":
    return
  documents = _documents(data.source, data.text_field)
  for split in ("train", "eval") if data.eval_fraction > 0 else ("train",):
    _split_indices(len(documents), data.eval_fraction, split)
  starts = np.unique(np.minimum(documents.starts()[:first], len(documents) - 1))
  tokens = 0
  for index in starts:
    text = documents.read(int(index))
    if "\x00" in text or text.count("\ufffd") > max(8, len(text) // 100):
      raise ValueError(f"data.source: {documents.file_of(int(index))} is not UTF-8 text (NUL bytes"
                       " or undecodable bytes); the source takes .txt, .jsonl or .parquet text")
    tokens += len(tokenizer.encode(text))
  if not tokens:
    raise ValueError(f"data.source={data.source!r}: its first documents hold no tokens")


def describe_source(config: TrainConfig) -> str:
  """A short human description of `config.data.source`, e.g. "stdlib: 674 files, 11.4 MB"."""
  data = config.data
  if data.source == "synthetic":
    return f"synthetic: uniform random tokens, seed {data.seed}"
  documents = _documents(data.source, data.text_field)
  size = f"{documents.num_bytes / 1e6:.1f} MB"
  if documents.name == "stdlib":
    return f"stdlib: {len(documents.files)} files, {size}"
  return f"{documents.name}: {len(documents.files)} files, {len(documents)} documents, {size}"
