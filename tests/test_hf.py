"""Hugging Face interop: logits parity with transformers, bitwise round trips, sharded import, CLI."""

import json
import shutil

import numpy as np
import pytest
import tokenizers
import torch
import transformers
from safetensors.numpy import save_file

import sharding
from configs import moe as moe_configs
from models import abstract_model, hf, param_names
from models.hf import layouts as hf_layouts
from models.hf import registry as hf_registry
from models.hf.checkpoint import SafetensorsFiles
from tests.test_cli import assert_one_line_error, meshtron
from trainer.config import TrainConfig

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, rope_theta=10_000.0, rms_norm_eps=1e-5)
# original_max_position_embeddings=16 puts this head_dim's wavelengths on all three sides of the
# Llama-3 rule (kept, interpolated, slowed), so a wrong scaling shows in the logits.
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
TOKENS = np.random.RandomState(0).randint(0, 128, (4, 24)).astype(np.int32)
PARITY = 1e-4  # max |logit difference| against transformers in float32, fixed by the issue
transformers.utils.logging.disable_progress_bar()


def random_hf_model(model_class, config, path, *, seed=0, norm_spread=0.1, dtype=torch.float32):
  """A random `model_class(config)` saved with save_pretrained; weights scaled up from HF's
  0.02-std init so logits are O(1) and any layout mistake is far above the tolerance (norm
  scales 1 +- norm_spread x N(0, 1), every other weight 0.15 x N(0, 1))."""
  torch.manual_seed(seed)
  model = model_class(config).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1 + norm_spread * torch.randn_like(p) if name.endswith("norm.weight")
              else 0.15 * torch.randn_like(p))
  model.to(dtype).save_pretrained(path)
  return model


def hf_llama(path, *, kv_heads=2, tied=False, rope_scaling=None, seed=0, dtype=torch.float32):
  """A random LlamaForCausalLM (random_hf_model)."""
  config = transformers.LlamaConfig(**TINY, num_key_value_heads=kv_heads, tie_word_embeddings=tied,
                                    rope_scaling=rope_scaling, attn_implementation="eager")
  return random_hf_model(transformers.LlamaForCausalLM, config, path, seed=seed, dtype=dtype)


def hf_logits(model, tokens=TOKENS) -> np.ndarray:
  with torch.no_grad():
    return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def tensors(model_dir) -> dict:
  files = SafetensorsFiles(str(model_dir))
  return {name: np.asarray(files.array(name)) for name in files.where}


def assert_same_tensors(a, b):
  """Bitwise: same names, shapes, dtypes and bytes."""
  ta, tb = tensors(a), tensors(b)
  assert sorted(ta) == sorted(tb)
  for name in ta:
    assert ta[name].dtype == tb[name].dtype and ta[name].tobytes() == tb[name].tobytes(), name


CASES = {
    "gqa_untied_llama3": dict(kv_heads=2, tied=False, rope_scaling=LLAMA3),
    "mha_tied_plain": dict(kv_heads=4, tied=True),
    "mqa_tied_llama3": dict(kv_heads=1, tied=True, rope_scaling=LLAMA3),
}


@pytest.mark.parametrize("case", CASES)
def test_import_export_parity(tmp_path, case):
  reference = hf_llama(tmp_path / "hf", **CASES[case])
  expected = hf_logits(reference)
  model = hf.from_pretrained(str(tmp_path / "hf"))
  cfg = model.config
  assert (cfg.num_kv_heads, cfg.tie_embeddings) == (CASES[case]["kv_heads"], CASES[case]["tied"])
  assert cfg.rope_scaling_factor == (8.0 if "llama3" in case else 1.0)
  diff = np.abs(np.asarray(model(TOKENS)) - expected).max()
  print(f"{case}: max |logits - transformers| = {diff:.3g}")
  assert diff < PARITY

  files = hf.save_pretrained(model, str(tmp_path / "out"), max_shard_bytes=40_000)
  assert "model.safetensors.index.json" in files and len(files) > 3  # several bounded shards
  assert_same_tensors(tmp_path / "hf", tmp_path / "out")  # parameters round-trip bitwise
  reloaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "out",
                                                           attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)
  again = hf.from_pretrained(str(tmp_path / "out"))
  np.testing.assert_array_equal(np.asarray(again(TOKENS)), np.asarray(model(TOKENS)))


def hf_mixtral(path, *, kv_heads=2, tied=False, seed=0):
  """A random MixtralForCausalLM (4 experts, top-2) saved with save_pretrained, weights scaled
  as in hf_llama; the router's too, so that top-2 choices are decisive, not near-ties."""
  config = transformers.MixtralConfig(**TINY, num_key_value_heads=kv_heads, head_dim=16,
                                      tie_word_embeddings=tied, num_local_experts=4,
                                      num_experts_per_tok=2, attn_implementation="eager")
  return random_hf_model(transformers.MixtralForCausalLM, config, path, seed=seed)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mixtral_import_export_parity(tmp_path, tied):
  """Mixtral's block_sparse_moe (router + per-expert w1/w3/w2) maps onto our MoE stack: logits
  equal transformers', export reloads in transformers with identical logits, and the tensors
  round-trip bitwise."""
  reference = hf_mixtral(tmp_path / "hf", tied=tied)
  expected = hf_logits(reference)
  model = hf.from_pretrained(str(tmp_path / "hf"))
  cfg = model.config
  assert cfg.moe is not None and (cfg.moe.num_experts, cfg.moe.experts_per_token) == (4, 2)
  assert model.layers is None and cfg.tie_embeddings == tied
  diff = np.abs(np.asarray(model(TOKENS)) - expected).max()
  print(f"mixtral tied={tied}: max |logits - transformers| = {diff:.3g}")
  assert diff < PARITY
  hf.save_pretrained(model, str(tmp_path / "out"))
  assert_same_tensors(tmp_path / "hf", tmp_path / "out")
  reloaded = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out",
                                                             attn_implementation="eager").eval()
  np.testing.assert_array_equal(hf_logits(reloaded), expected)


def test_rope_scaling_is_read_and_matters(tmp_path):
  """The parity above would be vacuous if scaling did not change the logits: drop it from
  config.json and the same weights give other logits."""
  expected = hf_logits(hf_llama(tmp_path / "hf", rope_scaling=LLAMA3))
  config = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert config["rope_parameters"]["rope_type"] == "llama3"  # what transformers 5 writes
  config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10_000.0}
  (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
  unscaled = np.asarray(hf.from_pretrained(str(tmp_path / "hf"))(TOKENS))
  assert np.abs(unscaled - expected).max() > 100 * PARITY
  # transformers 4's spelling (rope_theta + rope_scaling) reads the same.
  legacy = dict(config, rope_theta=10_000.0, rope_scaling=dict(LLAMA3, type="llama3"))
  del legacy["rope_parameters"]
  assert hf_registry.config_from_hf(legacy).rope_scaling_factor == 8.0


def test_bfloat16_checkpoint_imports_exactly(tmp_path):
  reference = hf_llama(tmp_path / "hf", dtype=torch.bfloat16)
  model = hf.from_pretrained(str(tmp_path / "hf"), dtype="float32")
  q = reference.model.layers[1].self_attn.q_proj.weight.detach().float().numpy()  # [H*Dh, D]
  ours = np.asarray(model.layers.attn.q.w[...][1])  # [D, H, Dh]
  np.testing.assert_array_equal(ours, q.T.reshape(64, 4, 16))
  np.testing.assert_array_equal(np.asarray(model.embed.table[...]),
                                reference.model.embed_tokens.weight.detach().float().numpy())


def test_sharded_import_fsdp4_tensor2(tmp_path, monkeypatch):
  """Streams into fsdp=4 x tensor=2: same logits, and each device's callback reads only its
  eighth of every q projection from disk."""
  reference = hf_llama(tmp_path / "hf", rope_scaling=LLAMA3)
  single = np.asarray(hf.from_pretrained(str(tmp_path / "hf"))(TOKENS))
  read_sizes = []
  original = hf_layouts.HEADS_IN.read

  def recording_read(hf_tensor, index, shape):
    block = original(hf_tensor, index, shape)
    read_sizes.append(block.size)
    return block

  monkeypatch.setattr(hf_layouts.HEADS_IN, "read", recording_read)
  mesh = sharding.make_mesh(sharding.MeshConfig(data=1, fsdp=4, tensor=2))
  with sharding.use_rules(mesh):
    cfg = hf.read_config(str(tmp_path / "hf"))
    _, abstract = abstract_model(cfg)
    shardings = sharding.tree_shardings(param_names(cfg), abstract, "params")
    model = hf.from_pretrained(str(tmp_path / "hf"), shardings=shardings)
    q = model.layers.attn.q.w[...]
    assert q.sharding == shardings["layers"]["attn"]["q"]["w"]
    assert q.addressable_shards[0].data.size == q.size // 8  # really split 8 ways
    logits = np.asarray(model(TOKENS))
  layer_q = 64 * 4 * 16
  assert read_sizes and max(read_sizes) == layer_q // 8
  assert np.abs(logits - hf_logits(reference)).max() < PARITY
  np.testing.assert_allclose(logits, single, atol=1e-5)


def test_bad_input_is_one_line(tmp_path):
  with pytest.raises(ValueError, match="config.json not found"):
    hf.from_pretrained(str(tmp_path))
  gpt2 = tmp_path / "gpt2"
  gpt2.mkdir()
  (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
  with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
    hf.from_pretrained(str(gpt2))
  hf_llama(tmp_path / "hf")
  wrong = tmp_path / "wrong_shape"
  shutil.copytree(tmp_path / "hf", wrong)
  config = json.loads((wrong / "config.json").read_text())
  (wrong / "config.json").write_text(json.dumps(dict(config, intermediate_size=128)))
  with pytest.raises(ValueError, match=r"mlp.gate_proj.weight has shape \[96, 64\] .* implies"
                                       r" \[128, 64\]"):
    hf.from_pretrained(str(wrong))
  missing = tmp_path / "missing"
  shutil.copytree(tmp_path / "hf", missing)
  kept = {k: v for k, v in tensors(missing).items() if k != "model.layers.1.mlp.up_proj.weight"}
  save_file(kept, str(missing / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match="missing 1 tensor.*model.layers.1.mlp.up_proj.weight"):
    hf.from_pretrained(str(missing))
  # A MoE Mixtral's format cannot hold (DeepSeek-style shared experts, sigmoid router, bias).
  with pytest.raises(ValueError, match="only Mixtral- and Qwen3-MoE-style MoEs export"):
    hf.save_params({}, moe_configs.model("deepseek_v3_like"), str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


def tiny_tokenizer(path) -> None:
  """A 128-token character BPE trained on a line of code (vocabularies are not downloadable)."""
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  trainer = tokenizers.trainers.BpeTrainer(vocab_size=128,
                                           special_tokens=["<unk>", "<s>", "</s>", "<pad>"])
  text = "def main(argv):\n  return sorted(x for x in argv if x.startswith('--'))\n" * 4
  tok.train_from_iterator([text, "import os, sys, json; print(len(sys.argv))"], trainer)
  tok.save(str(path))


def test_cli_convert_both_ways_and_train_from_hf(tmp_path):
  reference = hf_llama(tmp_path / "hf", rope_scaling=LLAMA3)
  tiny_tokenizer(tmp_path / "hf" / "tokenizer.json")
  result = meshtron("convert", "--from=hf", f"--model_dir={tmp_path}/hf", f"--out={tmp_path}/ckpt",
                    "--cpu_devices=2")
  assert result.returncode == 0, result.stderr[-3000:]
  assert (tmp_path / "ckpt" / "params").is_dir() and (tmp_path / "ckpt" / "tokenizer.json").exists()
  result = meshtron("convert", "--to=hf", f"--workdir={tmp_path}/ckpt", f"--out={tmp_path}/back")
  assert result.returncode == 0, result.stderr[-3000:]
  assert_same_tensors(tmp_path / "hf", tmp_path / "back")
  assert (tmp_path / "back" / "tokenizer.json").read_text() == \
      (tmp_path / "hf" / "tokenizer.json").read_text()

  # Fine-tune from the HF weights for one step at a negligible learning rate, export, reload.
  run = tmp_path / "run"
  result = meshtron("train", "--config=debug", f"--config.init_from=hf:{tmp_path}/hf",
                    f"--workdir={run}", "--cpu_devices=1", "--config.steps=1",
                    "--config.optim.learning_rate=1e-9", "--config.optim.warmup_steps=0",
                    "--config.batch_size=2", "--config.seq_len=32", "--config.eval_batches=1",
                    "--config.sample_tokens=0")
  assert result.returncode == 0, result.stderr[-3000:]
  resolved = json.loads((run / "config.json").read_text())
  assert resolved["model"]["embed_dim"] == 64 and resolved["model"]["num_kv_heads"] == 2
  assert resolved["model"]["rope_scaling_factor"] == 8.0
  assert resolved["data"]["tokenizer"] == f"{tmp_path}/hf/tokenizer.json"
  result = meshtron("convert", "--to=hf", f"--workdir={run}", f"--out={tmp_path}/tuned")
  assert result.returncode == 0, result.stderr[-3000:]
  tuned = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "tuned",
                                                        attn_implementation="eager").eval()
  assert np.abs(hf_logits(tuned) - hf_logits(reference)).max() < 1e-3
  assert (tmp_path / "tuned" / "tokenizer.json").exists()
  exported = json.loads((tmp_path / "tuned" / "config.json").read_text())
  assert exported["bos_token_id"] == reference.config.bos_token_id  # the original's extras kept


def test_cli_errors_are_one_line(tmp_path):
  assert_one_line_error(meshtron("convert", "--from=hf", f"--model_dir={tmp_path}",
                                 f"--out={tmp_path}/o"), "holds no config.json")
  (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
  assert_one_line_error(meshtron("train", f"--config.init_from=hf:{tmp_path}",
                                 f"--workdir={tmp_path}/w"), "unsupported architecture")
  with pytest.raises(ValueError, match="init_from must be empty or hf:"):
    TrainConfig(init_from="gpt2").validate()
