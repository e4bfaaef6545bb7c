"""Triton kernels of the three NSA branches, forward and backward (``*_backend="triton"``).

Importing this package imports Triton; `nsa_core` itself does not, and the ``triton`` backends import it
on first use. The kernels run on CUDA, or on the CPU under Triton's interpreter (``TRITON_INTERPRET=1``
in the environment before the first import; for tests only).
"""

from nsa_core.ops.triton.compression import triton_compressed_attention, triton_compressed_block_select
from nsa_core.ops.triton.gates import triton_gated_sum
from nsa_core.ops.triton.nsa import triton_nsa_attention
from nsa_core.ops.triton.selection import triton_selected_attention
from nsa_core.ops.triton.window import triton_sliding_window_attention

__all__ = [
    "triton_compressed_attention",
    "triton_compressed_block_select",
    "triton_gated_sum",
    "triton_nsa_attention",
    "triton_selected_attention",
    "triton_sliding_window_attention",
]
