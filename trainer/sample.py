"""Text generation from a trained model: greedy or temperature sampling over a sliding window."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils


# Tokens per compiled call: between calls a pending stop (SIGTERM, Ctrl-C) is honoured, and the
# device holds a chunk of output, not the whole request.
CHUNK = 1024


def generate(graphdef, params, prompt_ids, num_tokens: int, window: int, temperature: float,
             seed: int = 0, should_stop=lambda: False, chunk: int = CHUNK) -> np.ndarray:
  """Appends `num_tokens` tokens to `prompt_ids`, feeding the model the last `window` tokens.

  A compiled loop of `chunk` tokens (fixed-size buffer, no KV cache: simple and fast enough for
  tiny models), called until `num_tokens` are made or `should_stop()` (asked between chunks,
  on every process) says to stop; the tokens do not depend on `chunk`. temperature 0 is greedy.
  Returns the generated ids (without the prompt): fewer than `num_tokens` after a stop.
  """
  prompt = np.asarray(prompt_ids, np.int32)[-window:]
  buffer = np.zeros((window,), np.int32)
  buffer[:len(prompt)] = prompt
  size = max(1, min(chunk, num_tokens))

  @jax.jit
  def run(params, buffer, length, key):
    model = nnx.merge(graphdef, params)

    def one(i, carry):
      buffer, length, out, key = carry
      logits = model(buffer[None])[0, jnp.minimum(length, window) - 1].astype(jnp.float32)
      key, sub = jax.random.split(key)
      if temperature > 0:
        token = jax.random.categorical(sub, logits / temperature)
      else:
        token = jnp.argmax(logits)
      token = token.astype(jnp.int32)
      full = length >= window
      shifted = jnp.where(full, jnp.roll(buffer, -1), buffer)
      buffer = shifted.at[jnp.where(full, window - 1, length)].set(token)
      return buffer, length + 1, out.at[i].set(token), key

    return jax.lax.fori_loop(0, size, one, (buffer, length, jnp.zeros((size,), jnp.int32), key))

  carry = (buffer, np.int32(len(prompt)), np.asarray(jax.random.PRNGKey(seed)))
  chunks, made = [], 0
  while made < num_tokens and not (made and should_stop()):
    buffer, length, tokens, key = run(params, *carry)
    carry = (buffer, length, key)
    # numpy inputs are the same on every process; process_allgather fetches the result whole
    # even when the parameters (and so the output) live on several processes.
    chunks.append(np.asarray(multihost_utils.process_allgather(tokens, tiled=True)))
    made += size
  return np.concatenate(chunks)[:num_tokens] if chunks else np.zeros((0,), np.int32)
