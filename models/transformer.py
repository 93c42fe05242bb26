"""The decoder: embedding, stacked and scanned dense and MoE layers with a remat policy, head."""

import copy
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.accumulating_scan import accumulating_scan, aligned
from models.attention import Attention
from models.compute import REMAT_POLICIES, ComputeConfig
from models.config import ModelConfig
from models.layers import RESIDUAL, Einsum, Embed, RMSNorm, gather_sequence, projection_kw
from models.mla import MLAttention
from models import mtp
from models.mlp import MLP
from models.moe import MoE, summarize
from sharding import Layout, constrain, constrain_cotangent, local_layout
from sharding.layout import UNROLLED_STAGE_GROUPS


class DecoderBlock(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, compute, layout, *, rngs: nnx.Rngs):
    self._init_attention(cfg, compute, layout, rngs)
    self.mlp = MLP(cfg, compute, layout, rngs=rngs)

  def _init_attention(self, cfg: ModelConfig, compute, layout, rngs: nnx.Rngs) -> None:
    """The norms and attention every block has (created first: same init order in both)."""
    norm = dict(param_dtype=cfg.param_dtype, dtype=cfg.dtype)
    self.attn_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, **norm)
    self.attn = (Attention if cfg.mla is None else MLAttention)(cfg, compute, layout, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, **norm)

  def _attend(self, x_BLD, positions_BL, segment_ids_BL, window):
    # The norm's amax for tensorwise fp8's scales, from x (RMSNorm.sequence_amax).
    out = self.attn(self.attn_norm(x_BLD), positions_BL, segment_ids_BL, window=window,
                    input_amax=functools.partial(self.attn_norm.sequence_amax, x_BLD))
    return constrain(x_BLD + out, RESIDUAL)

  def __call__(self, x_BLD, positions_BL, segment_ids_BL, window=None):
    """`window`: this layer's sliding window (0: full attention); None: the model's."""
    x_BLD = self._attend(x_BLD, positions_BL, segment_ids_BL, window)
    out = self.mlp(self.mlp_norm(x_BLD),
                   input_amax=functools.partial(self.mlp_norm.sequence_amax, x_BLD))
    return constrain(x_BLD + out, RESIDUAL)


class MoEBlock(DecoderBlock):
  """The same block with the MoE feed-forward; also returns the layer's routing stats."""

  def __init__(self, cfg: ModelConfig, compute, layout, *,  # pylint: disable=super-init-not-called
               rngs: nnx.Rngs):
    self._init_attention(cfg, compute, layout, rngs)
    self.moe = MoE(cfg, compute, layout, rngs=rngs)

  def __call__(self, x_BLD, positions_BL, segment_ids_BL, window=None):
    x_BLD = self._attend(x_BLD, positions_BL, segment_ids_BL, window)
    y_BLD, stats = self.moe(self.mlp_norm(x_BLD))
    return constrain(x_BLD + y_BLD, RESIDUAL), stats


def _stack(block, num_layers: int, cfg: ModelConfig, compute, layout, rngs: nnx.Rngs,
           dim: str = "layers"):
  """`num_layers` blocks with their weights stacked on a leading dim named `dim`."""
  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: dim})
  def stack(rngs):
    return block(cfg, compute, layout, rngs=rngs)

  return stack(rngs)


def _per_layer(stack, block, num_layers: int, cfg: ModelConfig, compute, layout) -> nnx.List:
  """A stack's rows as `num_layers` blocks of their own (compute.scan_layers=False): each layer's
  weights are arrays of their own, so an unrolled step reads them where they are. A scan reads
  row l of a stacked weight through a copy (XLA:GPU's GEMMs take no slice of a buffer in place)
  and writes each layer's kept activations into stacked residuals, once per microbatch: 1.2 s of
  the NeMo 8B CP2 recipe's 14.2 s step. The rows keep the stack's values, so both forms start
  from the same weights."""
  rows = nnx.to_pure_dict(nnx.state(stack))
  graphdef, _ = nnx.split(nnx.eval_shape(lambda: block(cfg, compute, layout, rngs=nnx.Rngs(0))))
  return nnx.List([nnx.merge(graphdef, jax.tree.map(lambda a, i=i: a[i], rows))
                   for i in range(num_layers)])


def _window(period: int, j: int):
  """Layer j's window with model.full_attention_every = period: 0 (full attention) for the last
  layer of each group of `period`, None (the model's) for the others and without a pattern."""
  return 0 if period and (j + 1) % period == 0 else None


def _block_call(graphdef, positions_BL, segment_ids_BL):
  """(x, a block's state, window) -> (x, the block's per-layer outputs or None)."""
  def call(x, state, window):
    out = nnx.merge(graphdef, state)(x, positions_BL, segment_ids_BL, window=window)
    return out if isinstance(out, tuple) else (out, None)
  return call


def _weight_grads_as_stored(block, stacked):
  """`block` with each layer weight's gradient constrained to the weight's stored sharding. In
  a pipeline stage whose weights are split over fsdp (or ZeRO-3), XLA all-reduced each layer's
  gradient whole and stacked the chunk's gradients whole in float32 without it (Llama-3 70B,
  pipeline=8 x fsdp=4 x tensor=2 on 64 H100s: 49.2 -> 38.2 GiB, 761 -> 849 tok/s/GPU)."""
  names = {jax.tree_util.keystr(path): v.get_metadata()["out_sharding"][1:]  # less the stack's
           for path, v in jax.tree_util.tree_leaves_with_path(
               stacked, is_leaf=lambda v: isinstance(v, nnx.Variable))
           if isinstance(v, nnx.Param) and v.get_metadata().get("out_sharding")}

  def as_stored(path, w):  # the weights; other leaves (fp8 scales, counters) as they are
    key = jax.tree_util.keystr(path)
    if key not in names or not jnp.issubdtype(w.dtype, jnp.floating):
      return w
    return constrain_cotangent(w, names[key], "params")

  def call(x, state, window):
    weights = state if isinstance(state, dict) else nnx.to_pure_dict(state)
    return block(x, jax.tree_util.tree_map_with_path(as_stored, weights), window)
  return call


def layer_rows(present):
  """A stack's rows as the layer scan reads them. A numpy `present` (a position's rows known when
  tracing: the pipeline executor's row patterns) stays numpy, so each row's conditional has a
  constant predicate, which XLA drops: a padding row then costs nothing, also in the step-time
  model, which prices a conditional at its costliest branch."""
  return present if isinstance(present, np.ndarray) else jnp.asarray(present)


def unstacked(tree, n: int) -> list:
  """The n rows of a tree stacked on its leading dim, for a loop unrolled over them. A row is
  cut out by lax.split, whose transpose concatenates the rows' gradients: indexing's transpose
  pads each row's gradient and adds them up, and XLA 0.10.2's all-reduce reassociation turns
  that sum of bf16-converted f32 all-reduces into one bf16 all-reduce that keeps the f32
  reduction, which its combiner then packs with f32 all-reduces and its contiguous pass bitcasts
  f32 to bf16: wrong sums, and an abort on the DeepSeek-V3-like PP32 CP4 TP4 layout (tests/
  test_stage_rows.py). Numpy leaves (static row patterns) stay numpy."""
  leaves, treedef = jax.tree.flatten(tree)
  cut = lambda a: list(a) if isinstance(a, np.ndarray) else [
      r.squeeze(0) for r in jax.lax.split(a, [1] * n)]
  columns = [cut(a) for a in leaves]
  return [treedef.unflatten([c[i] for c in columns]) for i in range(n)]


class Transformer(nnx.Module):
  """A Llama decoder. Every layer weight has a leading `layers` dim (one compiled layer body);
  with compute.scan_layers=False each layer is a block of its own (`_per_layer`), unrolled.

  With `cfg.moe`, the first `moe.first_dense_layers` layers are dense (`layers`, None when
  there are none) and the rest form a second stack, `moe_layers`, scanned after it. With
  `cfg.mtp_depth`, `mtp` holds the multi-token prediction modules (models/mtp.py), which only the
  training loss runs (`mtp_hidden`).

  `compute` is how the run computes it (kernels, remat, fp8, loss chunking; default
  ComputeConfig()) and `layout` the run's resolved layout (sharding.Layout: the mesh, the kernels
  chosen for its platform, the context split, the train step's regions); without one, a single
  device's layout for JAX's default backend (sharding.local_layout), resolved here at build
  time. Both are static: nothing is read from an ambient scope while tracing.
  """

  def __init__(self, cfg: ModelConfig, compute: ComputeConfig | None = None,
               layout: Layout | None = None, *, rngs: nnx.Rngs):
    compute = ComputeConfig() if compute is None else compute
    layout = local_layout(cfg, compute) if layout is None else layout
    kw = dict(param_dtype=cfg.param_dtype, dtype=cfg.dtype)
    self.embed = Embed(cfg.vocab_size, cfg.embed_dim, cfg.embed_init_std, rngs=rngs,
                       layout=layout, **kw)
    def stack(block, num_layers):
      if not num_layers:
        return None
      stacked = _stack(block, num_layers, cfg, compute, layout, rngs)
      return stacked if compute.scan_layers else _per_layer(
          stacked, block, num_layers, cfg, compute, layout)
    self.layers = stack(DecoderBlock, cfg.dense_layers())
    self.moe_layers = stack(MoEBlock, cfg.moe_layers() if cfg.moe else 0)
    self.final_norm = RMSNorm(cfg.embed_dim, cfg.norm_eps, **kw)
    self.head = None if cfg.tie_embeddings else Einsum(
        (cfg.embed_dim, cfg.vocab_size), ("embed", "vocab"), (0,),
        **projection_kw(cfg, compute, layout, rngs, "head"))
    # Multi-token prediction (models/mtp.py), stacked like layers and created last, so the other
    # weights draw the same values with or without it. Its blocks are the last stack's kind.
    # Its stacked dim is `mtp_layers`, not split over pipeline stages: the last stage runs all.
    module = functools.partial(mtp.MTPModule, block=MoEBlock if cfg.moe else DecoderBlock)
    self.mtp = (_stack(module, cfg.mtp_depth, cfg, compute, layout, rngs, "mtp_layers")
                if cfg.mtp_depth else None)
    # Static (in the graph definition): the config this model was built from (a private copy),
    # how it is computed, and the layout it runs in.
    self.config = copy.deepcopy(cfg)
    self.compute = compute
    self.layout = layout

  def __call__(self, tokens_BL, positions_BL=None, segment_ids_BL=None, *, return_aux=False):
    """Returns logits [B, L, V] in the compute dtype; with return_aux, (logits, aux).

    Args:
      tokens_BL: int token ids.
      positions_BL: position of each token within its document (default 0..L-1).
      segment_ids_BL: document ids for packed rows (default: one document per row).
      return_aux: also return the MoE layers' routing stats (models.moe.summarize; {} for a
        dense model).
    """
    x, aux = self.hidden(tokens_BL, positions_BL, segment_ids_BL, return_aux=True)
    logits = self.logits(x)
    return (logits, aux) if return_aux else logits

  # The pieces of the forward pass, also run one by one by pipeline stages (trainer/pipeline_step).

  def embed_tokens(self, tokens_BL) -> jax.Array:
    """Token embeddings [B, L, D] on the residual stream."""
    return constrain(self.embed(tokens_BL), RESIDUAL)

  def run_layers(self, x_BLD, positions_BL, segment_ids_BL, present=None, accumulators=None):
    """The layer stacks over x, dense then MoE (whatever number of stacked layers each holds:
    the model's, or a pipeline stage's). Returns (x, aux) as for `hidden`'s return_aux.

    `present`: {stack name: [rows] bool} marks the rows of a stack that hold a layer, the others
    pass x through unrun (the padding of uneven pipeline stages); None or a missing stack: all.
    `accumulators`: {stack name: (gradient accumulator, use_max)}, whose gradient is the
    accumulator plus the stack's weight gradient, added layer by layer in the backward
    (models/accumulating_scan.py; the train step's microbatches); None: plain autodiff.
    """
    present, accumulators = present or {}, accumulators or {}
    if self.layers is not None:
      x_BLD, _ = self._run(self.layers, x_BLD, positions_BL, segment_ids_BL,
                           present.get("layers"), accumulators.get("layers"))
    if self.moe_layers is None:
      return x_BLD, {}
    rows = present.get("moe_layers")
    if rows is None and self.layout.in_pipeline_stage and self.config.moe.dispatch == "dropless":
      # Every row runs, but under the padded stacks' cond: a dropless region nested directly in
      # the stage's scan is refused by Shardy ("manual axes come before free axes": the stage's
      # `pipeline` reaches it as a free axis); under the cond it lowers and trains like one
      # device (tests/test_moe_pipeline.py). The padded stacks of uneven stages always had it.
      rows = np.ones(jax.tree.leaves(nnx.state(self.moe_layers))[0].shape[0], bool)
    x_BLD, per_layer = self._run(self.moe_layers, x_BLD, positions_BL, segment_ids_BL, rows,
                                 accumulators.get("moe_layers"))
    return x_BLD, summarize(per_layer, self.config.moe_layers())

  def logits(self, hidden_BLD) -> jax.Array:
    """The output head over final-norm outputs: [B, L, V]."""
    if self.head is None:
      logits = self.embed.attend(hidden_BLD)
    else:  # gathered once for the head's forward and weight-gradient dots (models/layers.py)
      logits = self.head("BLD,DV->BLV", gather_sequence(hidden_BLD, self.head.dtype))
    return constrain(logits, ("batch", "seq", "act_vocab"))

  def head_weights(self) -> jax.Array:
    """The output head as [D, V] in the compute dtype (tied: the embedding table transposed);
    `hidden(...) @ head_weights()` equals `__call__`'s logits."""
    if self.head is None:
      return self.embed.table[...].astype(self.embed.dtype).T
    return self.head.w[...].astype(self.head.dtype)

  def mtp_hidden(self, x_BLD, tokens_ahead, positions_BL, segment_ids_BL):
    """The multi-token prediction modules' head inputs (training only; models/mtp.py).

    Args:
      x_BLD: the last layer's output, before the final norm (`run_layers`).
      tokens_ahead: for each depth k = 1..mtp_depth, the input tokens k positions ahead [B, L]
        (tokens[:, i + k] at i; anything past a row's end, where the loss masks the targets),
        shifted by the caller in the natural sequence order, before any reordering.
      positions_BL, segment_ids_BL: as for `hidden`.
    Returns:
      (a [B, L, D] head input per depth, for `logits` or `head_weights` like `hidden`'s output;
      the blocks' routing stats as `run_layers` gives them, over the mtp_depth blocks, or {}).
    """
    if self.mtp is None or len(tokens_ahead) != self.config.mtp_depth:
      raise ValueError(f"mtp_hidden got {len(tokens_ahead)} depths of tokens for a model with"
                       f" model.mtp_depth={self.config.mtp_depth}")
    embeddings = [self.embed_tokens(tokens) for tokens in tokens_ahead]
    # In a pipeline stage (the last) the modules' pullback lives within one tick, as a chunk's.
    heads, stats = mtp.run(self.mtp, embeddings, x_BLD, positions_BL, segment_ids_BL,
                           "none" if self.layout.in_pipeline_stage else self.compute.remat)
    if stats[0] is None:
      return heads, {}
    return heads, summarize(jax.tree.map(lambda *a: jnp.stack(a), *stats), len(stats))

  def hidden(self, tokens_BL, positions_BL=None, segment_ids_BL=None, *, return_aux=False,
             present=None):
    """The final-norm output [B, L, D] in the compute dtype: everything but the output head;
    with return_aux, (hidden, aux) as for `__call__`.

    Args: as for `__call__`; `present` as for `run_layers`.
    """
    if positions_BL is None:
      positions_BL = jnp.broadcast_to(jnp.arange(tokens_BL.shape[1]), tokens_BL.shape)
    x, aux = self.run_layers(self.embed_tokens(tokens_BL), positions_BL, segment_ids_BL, present)
    x = self.final_norm(x)
    return (x, aux) if return_aux else x

  def _run(self, stack, x, positions_BL, segment_ids_BL, present=None, accumulator=None):
    """One stack over x: (x, per-layer outputs stacked, or None for dense blocks).
    `accumulator`: (gradient accumulator, use_max) for the stack's weights (`run_layers`).

    With model.full_attention_every = N, the scan steps over groups of N layers, unrolled inside,
    so that each layer's window is static (the kernels need it so) and the last one attends fully.
    Stacks hold whole groups (ModelConfig.validate), so the pattern follows the model's layer
    numbering in both stacks.
    """
    if isinstance(stack, nnx.List):
      return self._run_per_layer(stack, x, positions_BL, segment_ids_BL)
    graphdef, stacked = nnx.split(stack)
    accumulating = accumulator is not None
    if accumulating:  # as a pure dict, the accumulator's layout
      stacked = nnx.to_pure_dict(stacked)
      acc, use_max = aligned(stacked, *accumulator)
    period = self.config.full_attention_every
    windows = [_window(period, j) for j in range(period or 1)]
    block = _block_call(graphdef, positions_BL, segment_ids_BL)
    if self.layout.in_pipeline_stage and (self.layout.fsdp > 1 or self.layout.zero_stage == 3) \
        and not accumulating:
      block = _weight_grads_as_stored(block, stacked)
    layer = block
    # Padding rows: a conditional, so they run no matmuls (`layer_rows`); given traced (a
    # pipeline position's rows that the executor masks, sharding/pipeline/stage_split.
    # masked_rows), each row runs and a padding row's output and gradients are masked to zeros.
    masked = present is not None and not isinstance(present, np.ndarray)
    if present is not None:
      # Both branches type the layer's outputs like x (in a pipeline stage: varying over its
      # axis, whether or not a value depends on the stage's data), as cond requires.
      typed_like = lambda x, y: jax.tree.map(
          lambda a: a + jnp.zeros_like(x, a.dtype, shape=()), y)

      def layer(x, row, window):
        layer_state, here = row

        def run(x, layer_state):
          x_out, y = block(x, layer_state, window)
          return x_out, typed_like(x, y)

        def skip(x, layer_state):
          _, y = jax.eval_shape(block, x, layer_state, window)
          return x, typed_like(x, jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), y))
        if masked:
          x_out, y = block(x, layer_state, window)
          return jnp.where(here, x_out, x), jax.tree.map(lambda a: jnp.where(here, a, 0), y)
        return jax.lax.cond(here, run, skip, x, layer_state)
      stacked = (stacked, layer_rows(present))
      if accumulating:
        acc, use_max = (acc, None), (use_max, None)

    def body(x, rows):  # len(windows) consecutive layers, each with its own window
      if len(windows) == 1:
        return layer(x, rows, windows[0])
      ys = []
      for window, row in zip(windows, unstacked(rows, len(windows))):
        x, y = layer(x, row, window)
        ys.append(y)
      return x, jax.tree.map(lambda *a: jnp.stack(a), *ys)

    groups = jax.tree.leaves(stacked)[0].shape[0] // len(windows)
    grouped = lambda a: a.reshape(groups, len(windows), *a.shape[1:]) if period else a
    stacked = jax.tree.map(grouped, stacked)
    # A pipeline stage's chunk of a few layers runs unrolled: scanned, each tick stacked every
    # layer's residuals for its backward and sliced each layer's weights, copies that took 3.2
    # of the 70B TP4 PP8 VP5 step's 38 s (2 layers a chunk). Longer stacks stay scanned, which
    # keeps the compile time flat in the depth.
    unrolled_chunk = self.layout.in_pipeline_stage and groups <= UNROLLED_STAGE_GROUPS and \
        not accumulating
    scanned = self.compute.scan_layers and not unrolled_chunk
    # Not checkpointed, whatever compute.remat says: a pipeline stage's unrolled chunk
    # (Layout.stage_remat). Its pullback lives within one tick: the executor recomputes the
    # chunk's forward in its backward tick and differentiates it at once, so a layer
    # checkpoint only ran each layer's forward a third time (the DeepSeek-V3 recipe's MoE
    # exchanges too; of the regions nested in the stage, sharding.shard_map.stage_shard_map,
    # the flash kernel's keeps its outputs under remat "none", the experts' none).
    # Unless the stages keep their residuals (pipeline_recompute off): then the policy decides
    # what they keep, as without stages.
    kept = self.layout.in_pipeline_stage and not self.layout.pipeline_recompute
    if kept or not unrolled_chunk and (scanned or self.compute.remat != "none"
                                       or not self.layout.in_pipeline_stage):
      body = jax.checkpoint(body, policy=REMAT_POLICIES[self.compute.remat],
                            prevent_cse=not scanned)
    if accumulating:
      x, ys = accumulating_scan(body, x, stacked, jax.tree.map(grouped, acc), use_max)
    elif scanned:
      x, ys = jax.lax.scan(body, x, stacked)
    else:  # a pipeline stage's chunk, unrolled over its stacked weights
      outs = []
      for group in unstacked(stacked, groups):
        x, y = body(x, group)
        outs.append(y)
      ys = jax.tree.map(lambda *a: jnp.stack(a), *outs)
    return x, jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]) if period else a, ys)

  def _run_per_layer(self, blocks, x, positions_BL, segment_ids_BL):
    """`_run` for layers stored apart (`_per_layer`): unrolled, each layer checkpointed with the
    remat policy as the scan's body is, its window from the same pattern."""
    outs = []
    for j, block in enumerate(blocks):
      graphdef, state = nnx.split(block)
      layer = functools.partial(_block_call(graphdef, positions_BL, segment_ids_BL),
                                window=_window(self.config.full_attention_every, j))
      x, y = jax.checkpoint(layer, policy=REMAT_POLICIES[self.compute.remat])(x, state)
      outs.append(y)
    return x, jax.tree.map(lambda *a: jnp.stack(a), *outs)
