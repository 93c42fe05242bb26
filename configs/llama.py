"""Presets of the Llama architecture (Llama, the playbook's models, Mistral, Qwen3 dense): real sizes
(for planning and compiling) and tiny ones that train on CPU."""

import copy

from models.config import ModelConfig
from sharding.mesh import MeshConfig
from trainer.config import OptimConfig, TrainConfig

_LLAMA3 = dict(vocab_size=128_256, head_dim=128, rope_theta=500_000.0, norm_eps=1e-5,
               dtype="bfloat16")
_LLAMA31_ROPE = dict(rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                     rope_original_max_len=8192)
# The Ultra-Scale Playbook's benchmark models: as many KV heads as heads, vocab 131072.
_PLAYBOOK = dict(vocab_size=131_072, head_dim=128, rope_theta=500_000.0, dtype="bfloat16")
# Qwen3 (config.json of Qwen/Qwen3-8B and -32B): Llama's block with QK-norm, untied embeddings.
_QWEN3 = dict(vocab_size=151_936, head_dim=128, num_kv_heads=8, rope_theta=1_000_000.0,
              norm_eps=1e-6, qk_norm=True, dtype="bfloat16")

MODELS = {
    # Tiny: trains on 2 CPU cores in a few minutes (byte vocabulary, padded to 264 so 8 divides it).
    "debug": ModelConfig(),
    # Llama 3.2 1B (tied embeddings, rope scaling factor 32).
    "llama3_1b": ModelConfig(embed_dim=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                             mlp_dim=8192, tie_embeddings=True, **{**_LLAMA3, "head_dim": 64},
                             **{**_LLAMA31_ROPE, "rope_scaling_factor": 32.0}),
    "llama3_8b": ModelConfig(embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                             mlp_dim=14_336, **_LLAMA3, **_LLAMA31_ROPE),
    "llama3_70b": ModelConfig(embed_dim=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                              mlp_dim=28_672, **_LLAMA3, **_LLAMA31_ROPE),
    # Llama 2 70B (MaxText's llama2-70b: the published 64xH100 FSDP anchor is this model).
    "llama2_70b": ModelConfig(embed_dim=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                              mlp_dim=28_672, vocab_size=32_000, head_dim=128,
                              rope_theta=10_000.0, norm_eps=1e-5, dtype="bfloat16"),
    "llama3_405b": ModelConfig(embed_dim=16_384, num_layers=126, num_heads=128, num_kv_heads=8,
                               mlp_dim=53_248, **_LLAMA3, **_LLAMA31_ROPE),
    "playbook_1b": ModelConfig(embed_dim=2048, num_layers=16, num_heads=32, num_kv_heads=32,
                               mlp_dim=8192, tie_embeddings=True, **{**_PLAYBOOK, "head_dim": 64}),
    "playbook_3b": ModelConfig(embed_dim=3072, num_layers=28, num_heads=32, num_kv_heads=32,
                               mlp_dim=8192, tie_embeddings=True, **{**_PLAYBOOK, "head_dim": 96}),
    "playbook_8b": ModelConfig(embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=32,
                               mlp_dim=14_336, **_PLAYBOOK),
    "playbook_80b": ModelConfig(embed_dim=8192, num_layers=80, num_heads=64, num_kv_heads=64,
                                mlp_dim=28_672, **_PLAYBOOK),
    # Mistral 7B v0.1 (config.json of mistralai/Mistral-7B-v0.1): a 4096-token window everywhere.
    "mistral_7b": ModelConfig(vocab_size=32_000, embed_dim=4096, num_layers=32, num_heads=32,
                              num_kv_heads=8, head_dim=128, mlp_dim=14_336, rope_theta=10_000.0,
                              norm_eps=1e-5, sliding_window=4096, dtype="bfloat16"),
    "qwen3_8b": ModelConfig(embed_dim=4096, num_layers=36, num_heads=32, mlp_dim=12_288, **_QWEN3),
    "qwen3_32b": ModelConfig(embed_dim=5120, num_layers=64, num_heads=64, mlp_dim=25_600,
                             **_QWEN3),
}


def model(name: str) -> ModelConfig:
  """A deep copy of a model preset: overriding its nested fields (fp8, moe) never reaches the
  preset or another config built from it."""
  return copy.deepcopy(MODELS[name])


def debug() -> TrainConfig:
  """The tiny Llama on the Python standard library sources, byte-level, float32 on CPU: about
  3 minutes on 2 cores (500 steps of 32 x 128 tokens)."""
  return TrainConfig(model=model("debug"), steps=500, batch_size=32, seq_len=128)


def large(name: str) -> TrainConfig:
  """A real-size model with production-like defaults (for compile/plan; train on GPUs)."""
  return TrainConfig(model=model(name), mesh=MeshConfig(data=1, fsdp=-1), steps=10_000,
                     batch_size=256, seq_len=4096,
                     optim=OptimConfig(learning_rate=3e-4, warmup_steps=2000), log_every=1,
                     eval_every=1000, sample_tokens=0)
