"""MoE presets: a tiny one that trains on CPU, and Mixtral-, DeepSeek-V3- and Qwen3-MoE-sized
ones."""

import copy
import dataclasses

from configs import llama
from models.config import MLAConfig, MoEConfig, ModelConfig
from sharding.mesh import MeshConfig
from trainer.config import OptimConfig, TrainConfig

_QWEN3_MOE = dict(vocab_size=151_936, head_dim=128, rope_theta=1_000_000.0, norm_eps=1e-6,
                  qk_norm=True, dtype="bfloat16")
_QWEN3_ROUTER = dict(num_experts=128, experts_per_token=8, router="softmax",
                     load_balance_loss=0.001, router_z_loss=0.0, dispatch="dropless")
_DEEPSEEK_V3_MOE = MoEConfig(
    num_experts=256, experts_per_token=8, expert_mlp_dim=2048, num_shared_experts=1,
    first_dense_layers=3, router="sigmoid", load_balance_loss=0.0001, router_z_loss=0.0,
    bias_update_rate=0.001, routed_scaling=2.5, expert_groups=8, groups_per_token=4,
    dispatch="dropless")

MODELS = {
    # The debug Llama with 8 experts of half its MLP width, top-2: the same active parameters
    # per token as the dense debug model (+ a 128 x 8 router per layer), 4.5x its MLP weights.
    "debug_moe": dataclasses.replace(
        llama.MODELS["debug"],
        moe=MoEConfig(num_experts=8, experts_per_token=2, expert_mlp_dim=192,
                      dispatch="dropless")),
    # Mixtral 8x7B (arXiv:2401.04088; HF config: router_aux_loss_coef 0.02, no z-loss):
    # 46.7B parameters, 12.9B active.
    "mixtral_8x7b": ModelConfig(
        vocab_size=32_000, embed_dim=4096, num_layers=32, num_heads=32, num_kv_heads=8,
        head_dim=128, mlp_dim=14_336, rope_theta=1_000_000.0, norm_eps=1e-5, dtype="bfloat16",
        moe=MoEConfig(num_experts=8, experts_per_token=2, router="softmax",
                      load_balance_loss=0.02, router_z_loss=0.0, dispatch="dropless")),
    # DeepSeek-V3's MoE (arXiv:2412.19437) on GQA attention: 61 layers, 3 dense (MLP 18432),
    # 256 routed experts of 2048 top-8 + 1 shared, sigmoid router with normalized top-k weights
    # x 2.5, aux-loss-free bias (rate 0.001), a tiny balance loss (0.0001) and group-limited
    # routing (the experts' top-8 from the best 4 of 8 groups), on GQA attention (128 query
    # heads, 8 KV heads of 128) where DeepSeek-V3 (`deepseek_v3`, below) has MLA.
    "deepseek_v3_like": ModelConfig(
        vocab_size=129_280, embed_dim=7168, num_layers=61, num_heads=128, num_kv_heads=8,
        head_dim=128, mlp_dim=18_432, rope_theta=10_000.0, norm_eps=1e-6, dtype="bfloat16",
        moe=_DEEPSEEK_V3_MOE),
    # DeepSeek-V3 itself (arXiv:2412.19437; HF config.json of deepseek-ai/DeepSeek-V3): the MoE
    # above on multi-head latent attention (128 heads, query latent 1536, kv latent 512, q/k heads
    # 128 + 64 rope, v heads 128) with one multi-token-prediction module (loss weight 0.3, the
    # report's first 10T tokens). 671B parameters and 37B active, plus 11.6B in the module (the
    # report's 14B counts the checkpoint's copies of the embedding and head, which it shares).
    # RoPE without YaRN: the 4K pre-training's (YaRN's factor 40 is the long-context extension).
    "deepseek_v3": ModelConfig(
        vocab_size=129_280, embed_dim=7168, num_layers=61, num_heads=128, num_kv_heads=128,
        head_dim=192, mlp_dim=18_432, rope_theta=10_000.0, norm_eps=1e-6, dtype="bfloat16",
        mla=MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128),
        moe=_DEEPSEEK_V3_MOE, mtp_depth=1, mtp_loss_weight=0.3),
    # Qwen3-MoE (config.json of Qwen/Qwen3-30B-A3B and -235B-A22B): QK-norm, every layer a MoE of
    # 128 experts top-8 (softmax, norm_topk_prob), no shared expert, balance loss 0.001.
    "qwen3_30b_a3b": ModelConfig(
        embed_dim=2048, num_layers=48, num_heads=32, num_kv_heads=4, mlp_dim=6144,
        **_QWEN3_MOE, moe=MoEConfig(expert_mlp_dim=768, **_QWEN3_ROUTER)),
    "qwen3_235b_a22b": ModelConfig(
        embed_dim=4096, num_layers=94, num_heads=64, num_kv_heads=4, mlp_dim=12_288,
        **_QWEN3_MOE, moe=MoEConfig(expert_mlp_dim=1536, **_QWEN3_ROUTER)),
}


def model(name: str) -> ModelConfig:
  """A deep copy of a model preset (see configs.llama.model)."""
  return copy.deepcopy(MODELS[name])


def debug_moe() -> TrainConfig:
  """The tiny MoE on the Python standard library sources, like the `debug` Llama.

  Under pure expert parallelism its dense weights (10% of its bytes, more than in real MoEs)
  stay whole on every device by design: the replication guard allows 20%.
  """
  return TrainConfig(model=model("debug_moe"), steps=500, batch_size=32, seq_len=128,
                     max_replicated_fraction=0.2)


def large(name: str) -> TrainConfig:
  """A real-size MoE with production-like defaults (for compile/plan; train on GPUs)."""
  return TrainConfig(model=model(name), mesh=MeshConfig(data=1, fsdp=-1), steps=10_000,
                     batch_size=256, seq_len=4096,
                     optim=OptimConfig(learning_rate=3e-4, warmup_steps=2000), log_every=1,
                     eval_every=1000, sample_tokens=0)
