"""DDP's own errors explained (`nsa_diag.analysis.ddp_errors`), without processes."""

from __future__ import annotations

from nsa_diag.analysis.ddp_errors import explain_ddp_error


def test_ddp_errors_explained_with_names_and_fix() -> None:
    names = ["embed.weight", "blocks.0.attn.kv_win.weight", "lm_head.weight"]
    unfinished = (
        "Expected to have finished reduction in the prior iteration before starting a new one. ... "
        "Parameter indices which did not receive grad for rank 1: 1"
    )
    explained = explain_ddp_error(unfinished, names)
    assert explained is not None
    assert (explained.kind, explained.params, explained.ranks) == (
        "unused-parameters", ("blocks.0.attn.kv_win.weight",), (1,)
    )  # fmt: skip
    assert "find_unused_parameters=True" in explained.explanation
    assert "--find-unused" not in explained.explanation  # our flag only for our own worker
    assert "--find-unused" in explain_ddp_error(unfinished, names, cli=True).explanation  # type: ignore[union-attr]
    twice = explain_ddp_error(
        "Expected to mark a variable ready only once. ... Parameter at index 2 has been marked as ready "
        "twice.",
        names,
    )
    assert twice is not None
    assert (twice.kind, twice.params) == ("marked-ready-twice", ("lm_head.weight",))
    assert "use_reentrant=False" in twice.explanation
    assert "static_graph=True" in twice.explanation
    # torch's static-graph message begins with the unfinished-reduction one's words
    changed = explain_ddp_error(
        "Expected to have finished reduction in the prior iteration before starting a new one. This error "
        "indicates that your training graph has changed in this iteration, e.g., one parameter is used in "
        "first iteration, but then got unused in the second iteration. this is not compatible with "
        "static_graph set to True.\nParameter indices which did not receive grad for rank 0: 0",
        names,
    )
    assert changed is not None
    assert (changed.kind, changed.params) == ("static-graph-changed", ("embed.weight",))
    assert explain_ddp_error("CUDA out of memory", names) is None
