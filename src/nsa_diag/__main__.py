"""`python -m nsa_diag` runs the CLI, the same as the `nsa-diag` console script.

The signal handlers go in before anything heavy is imported (`nsa_diag.interrupts`): a Ctrl-C while Typer,
pydantic or torch load is noted, never lost.
"""

from nsa_diag import interrupts

interrupts.install()

from nsa_diag.app import main  # noqa: E402 (after the handlers, on purpose)

if __name__ == "__main__":
    main()
