"""`python -m nsa_diag` runs the CLI, the same as the `nsa-diag` console script."""

from nsa_diag.app import main

if __name__ == "__main__":
    main()
