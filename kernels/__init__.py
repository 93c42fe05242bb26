"""Kernels with single-device semantics; each has a plain-JAX reference beside it."""

from kernels.attention import attention
from kernels.cross_entropy import chunked_cross_entropy
from kernels.flash_attention import BlockSizes, flash_attention
from kernels.grouped_matmul import grouped_matmul
from kernels.ring_attention import allgather_attention, ring_attention
from kernels.ring_flash_attention import ring_flash_attention
from kernels.ulysses import ulysses_attention, ulysses_ring_attention

__all__ = ["BlockSizes", "allgather_attention", "attention", "chunked_cross_entropy",
           "flash_attention", "grouped_matmul", "ring_attention", "ring_flash_attention",
           "ulysses_attention",
           "ulysses_ring_attention"]
