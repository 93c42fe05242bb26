"""Public sharding API: the mesh, the logical rules, constrain() and state shardings."""

from sharding.collective_matmul import logical_all_gather_matmul, logical_matmul_reduce_scatter
from sharding.context import (active, axes_of, constrain, constrain_tree, current, excluding,
                              gradient_replica_axes, is_names, mesh_sizes, named_sharding,
                              record_constraints, replicated, spec, tree_shardings, use_rules)
from sharding.context_parallel import context_attention, sequence_axes, tokens_split, zigzag
from sharding.expert import dropless_experts
from sharding.layout import Layout, RunLayout, layout_of, resolve
from sharding.mesh import (AXES, BATCH_AXES, LayoutError, MeshConfig, make_mesh, resolve_sizes,
                           split_across_hosts)
from sharding.rules import (DEFAULT_RULES, layout_rules, logical_to_spec, lookup_moves_rows,
                            parse_overrides, role_rules, split_vocab_over_fsdp, with_overrides)
from sharding.shard_map import shard_map_logical

__all__ = [
    "active", "axes_of",
    "Layout", "RunLayout", "layout_of", "resolve",
    "context_attention", "sequence_axes", "tokens_split", "zigzag",
    "logical_all_gather_matmul", "logical_matmul_reduce_scatter",
    "AXES", "BATCH_AXES", "DEFAULT_RULES", "LayoutError", "MeshConfig", "constrain",
    "constrain_tree", "current", "dropless_experts", "excluding", "gradient_replica_axes", "is_names", "layout_rules", "logical_to_spec", "lookup_moves_rows", "make_mesh",
    "mesh_sizes", "named_sharding", "parse_overrides", "record_constraints", "replicated",
    "role_rules", "shard_map_logical", "spec", "split_across_hosts", "split_vocab_over_fsdp", "tree_shardings", "use_rules", "with_overrides",
]
