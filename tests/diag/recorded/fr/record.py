"""Records the flight recorder fixtures of `test_flight.py` from real 2-rank gloo jobs (`fr_job.py`):

python tests/diag/recorded/fr/record.py   # rewrites skipped/, mismatch/ and missing/ here
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

for case in ("skipped", "mismatch", "missing"):
    out = HERE / case
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    env = {**os.environ, "FR_CASE": case, "TORCH_FR_BUFFER_SIZE": "2000"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0"]
    subprocess.run([*torchrun, str(HERE / "fr_job.py"), str(out)], env=env, timeout=120, check=False)
    print(case, sorted(p.name for p in out.iterdir()))
