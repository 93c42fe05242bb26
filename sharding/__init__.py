"""Public sharding API (what runs in the step): the mesh, the logical rules, the layout object and
its resolution, the sharding scope (constrain() and state shardings), and the collectives that
take the layout. The analysis rooms are sharding.plan and sharding.xla."""

from sharding.collective_matmul import (logical_all_gather_matmul, logical_matmul_reduce_scatter,
                                         logical_sum_reduce_scatter, sum_terms)
from sharding.context_parallel import context_attention, zigzag
from sharding.expert import dropless_experts
from sharding.layout import Layout
from sharding.mesh import (AXES, BATCH_AXES, LayoutError, MeshConfig, make_mesh, mesh_sizes,
                           resolve_sizes, split_across_hosts)
from sharding.resolution import layout_of, local_layout, resolve
from sharding.rules import (DEFAULT_RULES, layout_rules, logical_to_spec, lookup_moves_rows,
                            parse_overrides, role_rules, split_vocab_over_fsdp, with_overrides)
from sharding.scope import (constrain, constrain_cotangent, constrain_tree, excluding, is_names,
                            named_sharding, record_constraints, replicated, spec,
                            tree_shardings, use_rules)
from sharding.lookup import embedding_lookup
from sharding.shard_map import shard_map_logical

__all__ = [
    "AXES", "BATCH_AXES", "constrain", "constrain_cotangent", "constrain_tree",
    "context_attention", "DEFAULT_RULES", "dropless_experts", "embedding_lookup",
    "excluding", "is_names", "Layout", "layout_of", "layout_rules",
    "LayoutError", "local_layout", "logical_all_gather_matmul", "logical_matmul_reduce_scatter",
    "logical_sum_reduce_scatter", "logical_to_spec", "lookup_moves_rows", "make_mesh",
    "mesh_sizes", "MeshConfig", "named_sharding", "parse_overrides", "record_constraints",
    "replicated", "resolve", "resolve_sizes", "role_rules", "shard_map_logical", "spec",
    "split_across_hosts", "split_vocab_over_fsdp", "sum_terms", "tree_shardings", "use_rules",
    "with_overrides", "zigzag",
]
