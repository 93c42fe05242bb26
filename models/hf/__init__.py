"""Hugging Face interop: config.json and safetensors streamed into shardings and back out."""

from models.hf.checkpoint import (from_pretrained, load_params, read_config, read_hf_config,
                                  save_params, save_pretrained, tokenizer_file)

__all__ = ["from_pretrained", "load_params", "read_config", "read_hf_config", "save_params",
           "save_pretrained", "tokenizer_file"]
