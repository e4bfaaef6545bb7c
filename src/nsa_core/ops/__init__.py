"""Functional NSA: one module per branch, each with its backends, and the naive reference."""

from nsa_core.ops.compression import (
    compressed_attention,
    masked_compressed_attention,
    num_compressed_blocks,
    unfold_blocks,
)
from nsa_core.ops.reference import (
    naive_compressed_attention,
    naive_select_blocks,
    naive_selected_attention,
    naive_sliding_window_attention,
)
from nsa_core.ops.selection import (
    block_importance,
    gather_selected_attention,
    masked_selected_attention,
    packed_selected_attention,
    select_blocks,
    selected_attention,
)
from nsa_core.ops.window import (
    chunked_sliding_window_attention,
    masked_sliding_window_attention,
    sliding_window_attention,
)

__all__ = [
    "block_importance",
    "chunked_sliding_window_attention",
    "compressed_attention",
    "gather_selected_attention",
    "masked_compressed_attention",
    "masked_selected_attention",
    "masked_sliding_window_attention",
    "naive_compressed_attention",
    "naive_select_blocks",
    "naive_selected_attention",
    "naive_sliding_window_attention",
    "num_compressed_blocks",
    "packed_selected_attention",
    "select_blocks",
    "selected_attention",
    "sliding_window_attention",
    "unfold_blocks",
]
