"""Public sharding API (what runs in the step): the mesh, the logical rules, the resolved layout,
constrain() and state shardings. The analysis rooms are sharding.plan and sharding.xla."""

from sharding.collective_matmul import logical_all_gather_matmul, logical_matmul_reduce_scatter
from sharding.scope import (active, axes_of, constrain, constrain_tree, current, excluding,
                              gradient_replica_axes, is_names, mesh_sizes, named_sharding,
                              in_manual_region, platform,
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
    "active", "AXES", "axes_of", "BATCH_AXES", "constrain", "constrain_tree", "context_attention",
    "current", "DEFAULT_RULES", "dropless_experts", "excluding", "gradient_replica_axes",
    "is_names", "Layout", "layout_of", "layout_rules", "LayoutError", "logical_all_gather_matmul",
    "logical_matmul_reduce_scatter", "logical_to_spec", "lookup_moves_rows", "make_mesh",
    "mesh_sizes", "MeshConfig", "named_sharding", "parse_overrides", "in_manual_region", "platform", "record_constraints",
    "replicated", "resolve", "resolve_sizes", "role_rules", "RunLayout", "sequence_axes",
    "shard_map_logical", "spec", "split_across_hosts", "split_vocab_over_fsdp", "tokens_split", "tree_shardings",
    "use_rules", "with_overrides", "zigzag",
]
