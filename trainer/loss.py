"""Masked next-token cross-entropy in float32 (optional z-loss; vocab-parallel friendly), and
the MoE router losses and metrics in the same summed-over-tokens convention."""

import jax
import jax.numpy as jnp

from kernels.cross_entropy import chunked_cross_entropy
from sharding import constrain


def cross_entropy_sums(logits_BLV, targets_BL, mask_BL, z_loss: float = 0.0):
  """Summed (not averaged) losses over the unmasked tokens.

  Sums let gradient accumulation divide by the token count of the whole batch, so N microbatches
  give exactly the gradient of one big batch. The target logit is picked with a masked sum over
  the vocab rather than a gather, so a vocab-sharded logits array is never gathered.

  Returns:
    (loss_sum, {"nll_sum", "z_loss_sum", "tokens"}) where loss_sum = nll_sum + z_loss * z_sum.
  """
  logits = logits_BLV.astype(jnp.float32)
  lse = jax.nn.logsumexp(logits, axis=-1)
  vocab_ids = jnp.arange(logits.shape[-1], dtype=targets_BL.dtype)[None, None]
  target_logit = jnp.sum(jnp.where(vocab_ids == targets_BL[..., None], logits, 0.0), axis=-1)
  mask = mask_BL.astype(jnp.float32)
  nll_sum = jnp.sum((lse - target_logit) * mask)
  z_sum = jnp.sum(jnp.square(lse) * mask)
  loss_sum = nll_sum + z_loss * z_sum
  return loss_sum, {"nll_sum": nll_sum, "z_loss_sum": z_sum, "tokens": jnp.sum(mask)}


def chunked_cross_entropy_sums(hidden_BLD, head_DV, targets_BL, mask_BL, z_loss: float = 0.0,
                               chunk: int = 256):
  """The same sums and stats as `cross_entropy_sums(hidden @ head, ...)`, computed over sequence
  chunks so the [B, L, V] logits never exist. Each chunk's logits keep the vocab dim sharded like
  the dense logits (vocab-parallel over `tensor`)."""
  return chunked_cross_entropy(
      hidden_BLD, head_DV, targets_BL, mask_BL, z_loss=z_loss, chunk=chunk,
      constrain_logits=lambda x: constrain(x, ("batch", "seq", "act_vocab")))


def head_loss_sums(model, hidden_BLD, batch: dict, z_loss: float = 0.0):
  """The model's output head over its final hidden states, and the summed loss: dense logits
  (`cross_entropy_sums`) or, when the run computes it "chunked" (model.compute.loss_impl), the
  head and loss over sequence chunks (`chunked_cross_entropy_sums`); one function for the plain
  and the pipelined step."""
  compute = model.compute
  if compute.loss_impl == "chunked":
    return chunked_cross_entropy_sums(hidden_BLD, model.head_weights(), batch["targets"],
                                      batch["loss_mask"], z_loss, compute.loss_chunk_size)
  return cross_entropy_sums(model.logits(hidden_BLD), batch["targets"], batch["loss_mask"],
                            z_loss)


def add_moe_losses(loss_sum, stats: dict, aux: dict, mask_BL, moe):
  """Adds the MoE router losses to a summed loss, and their sums and routing counts to stats.

  Both losses are sums over rows, like the next-token loss: each sequence's balance loss times
  its loss tokens, each token's z-loss times its mask. Dividing by the batch's token count then
  gives weight x (token-weighted) mean for any split into microbatches and replicas.

  Args:
    loss_sum: the summed next-token loss.
    stats: its stats (with "tokens").
    aux: the model's routing stats (models.moe.summarize).
    mask_BL: the loss mask.
    moe: the model's MoEConfig (the weights of the load-balancing loss and the router z-loss).
  Returns:
    (loss_sum, stats + {"moe_aux_sum", "moe_z_sum", "moe_dropped", "moe_load" [layers, E]}).
  """
  mask = mask_BL.astype(jnp.float32)
  aux_sum = jnp.sum(aux["aux_loss"] * jnp.sum(mask, axis=1))
  z_sum = jnp.sum(aux["z_loss"] * mask)
  loss_sum = loss_sum + moe.load_balance_loss * aux_sum + moe.router_z_loss * z_sum
  counts = jax.lax.stop_gradient((aux["dropped"], aux["load"]))
  return loss_sum, dict(stats, moe_aux_sum=aux_sum, moe_z_sum=z_sum, moe_dropped=counts[0],
                        moe_load=counts[1])


def moe_metrics(stats: dict, tokens) -> dict:
  """Per-step MoE metrics from summed stats: mean router losses, the fraction of assignments
  dropped, and each expert's load as a multiple of its fair share (1 = balanced): min and max
  over layers and experts, coefficient of variation over experts averaged over layers."""
  load = stats["moe_load"]
  total = jnp.sum(load, axis=-1, keepdims=True)
  # Every layer routes each token somewhere; a row that routed nothing is the padding of an
  # uneven pipeline stage (sharding/pipeline/stage_split.py), left out.
  real = total > 0
  share = load * load.shape[-1] / jnp.maximum(total, 1.0)
  cv = jnp.std(share, axis=-1, keepdims=True) / jnp.maximum(jnp.mean(share, -1, keepdims=True),
                                                            1e-9)
  return {
      "moe_aux_loss": stats["moe_aux_sum"] / tokens,
      "moe_z_loss": stats["moe_z_sum"] / tokens,
      "moe_dropped_fraction": stats["moe_dropped"] / jnp.maximum(jnp.sum(total), 1.0),
      "moe_load_min": jnp.min(jnp.where(real, share, jnp.inf)),
      "moe_load_max": jnp.max(jnp.where(real, share, -jnp.inf)),
      "moe_load_cv": jnp.sum(jnp.where(real, cv, 0.0)) / jnp.maximum(jnp.sum(real), 1),
  }


def mtp_batch(batch: dict, depth: int) -> dict:
  """The batch plus, for each multi-token prediction depth k = 1..depth, the tokens k positions
  ahead (`mtp_inputs_k`: inputs[i + k]), the targets k positions ahead (`mtp_targets_k`:
  targets[i + k] = t_{i+k+1}) and their mask (`mtp_mask_k`: loss_mask[i + k] where position
  i + k is in the same document as i, 0 past the row's end). Shifts need the natural sequence
  order: call it before any reordering (sharding.zigzag). Idempotent; depth 0: the batch."""
  if not depth or f"mtp_mask_{depth}" in batch:
    return batch
  batch = dict(batch)
  segments = batch["segment_ids"]
  for k in range(1, depth + 1):
    ahead = lambda x, k=k: jnp.pad(x[:, k:], ((0, 0), (0, k)))  # zeros past the end
    same_document = ahead(segments) == segments
    batch[f"mtp_inputs_{k}"] = ahead(batch["inputs"])
    batch[f"mtp_targets_{k}"] = ahead(batch["targets"])
    batch[f"mtp_mask_{k}"] = ahead(batch["loss_mask"]) * same_document
  return batch


def add_mtp_losses(model, loss_sum, stats: dict, x_BLD, batch: dict, z_loss: float = 0.0):
  """Adds DeepSeek-V3's multi-token prediction loss: mtp_weight / D x the sum over depths k of
  depth k's summed cross-entropy (`head_loss_sums` over the model's shared head, z-loss
  included); divided like every sum by the batch's (main) tokens, this is the paper's
  lambda / D x sum_k L_MTP^k, each a sum over the valid positions / T.

  The modules' MoE blocks (if any) add their router losses as the model's layers do, with the
  same weights (each a mean over the D blocks); their loads move their routing biases.

  Args:
    model: the Transformer (with `mtp`).
    loss_sum, stats: the main loss and its stats.
    x_BLD: the last layer's output before the final norm.
    batch: with `mtp_batch`'s keys.
    z_loss: the step's z-loss weight.
  Returns:
    (loss_sum, stats + {"mtp_loss_sum": the unweighted sum over depths, "mtp_nll_sum" [D],
    "mtp_tokens" [D]; with MoE blocks "mtp_moe_aux_sum", "mtp_moe_z_sum", "mtp_moe_dropped",
    "mtp_moe_load" [D, E]}).
  """
  cfg = model.config
  depths = range(1, cfg.mtp_depth + 1)
  heads, aux = model.mtp_hidden(x_BLD, [batch[f"mtp_inputs_{k}"] for k in depths],
                                batch["positions"], batch["segment_ids"])
  sums, nll, tokens = [], [], []
  for k, hidden in zip(depths, heads):
    targets = {"targets": batch[f"mtp_targets_{k}"], "loss_mask": batch[f"mtp_mask_{k}"]}
    depth_sum, depth_stats = head_loss_sums(model, hidden, targets, z_loss)
    sums.append(depth_sum)
    nll.append(depth_stats["nll_sum"])
    tokens.append(depth_stats["tokens"])
  mtp_sum = sum(sums)
  loss_sum = loss_sum + cfg.mtp_loss_weight / cfg.mtp_depth * mtp_sum
  stats = dict(stats, mtp_loss_sum=mtp_sum, mtp_nll_sum=jnp.stack(nll),
               mtp_tokens=jnp.stack(tokens))
  if aux:
    loss_sum, moe = add_moe_losses(loss_sum, {}, aux, batch["loss_mask"], cfg.moe)
    stats.update({f"mtp_{name}": value for name, value in moe.items()})
  return loss_sum, stats


def mtp_metrics(stats: dict, tokens, weight: float) -> dict:
  """Per-step multi-token prediction metrics: `mtp_loss`, what it adds to the loss, and
  `mtp_nll_k`, depth k's mean cross-entropy over its own predicted tokens (like `nll`)."""
  depth = stats["mtp_nll_sum"].shape[0]
  metrics = {"mtp_loss": weight / depth * stats["mtp_loss_sum"] / tokens}
  for k in range(depth):
    metrics[f"mtp_nll_{k + 1}"] = stats["mtp_nll_sum"][k] / jnp.maximum(stats["mtp_tokens"][k], 1)
  return metrics


def attention_segments(batch: dict, document_mask: bool):
  """The document ids attention masks by, or None (one causal mask over the row) where rows need
  none (StepConfig.document_mask): cuDNN then runs its causal kernel without the [B, 1, L, L]
  mask bias it otherwise reads in every call (the lent H200's trace, 2026-11-26)."""
  return batch["segment_ids"] if document_mask else None
