"""The light probe: what nsa-diag puts into a process to report its progress (stdlib and torch only).

`hooks`: progress hooks on a model's layers and NSA branches, used by our worker and by a user's job.
"""
