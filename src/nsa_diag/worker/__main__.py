"""``python -m nsa_diag.worker <case_dir>``: the child process that runs one case (see `main`).

Its first act is to tie its life to nsa-diag's (`nsa_diag.worker.tether`), before the heavy imports.
"""

import sys

from nsa_diag.worker import tether

tether.hold()

from nsa_diag.worker.main import main  # noqa: E402 (after the tether, on purpose)

if __name__ == "__main__":
    sys.exit(main())
