"""``python -m nsa_diag.worker <case_dir>``: the child process that runs one case (see `main`)."""

import sys

from nsa_diag.worker.main import main

if __name__ == "__main__":
    sys.exit(main())
