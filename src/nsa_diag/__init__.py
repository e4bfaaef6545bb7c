"""nsa-diag: find out, with evidence, why a Native Sparse Attention training job hangs, is slow, runs out
of memory or computes wrong gradients.

The toolkit drives the NSA model in `nsa_core`; `nsa_core` never imports it. The CLI lives in `app.py`.
"""

__version__ = "0.1.0"
