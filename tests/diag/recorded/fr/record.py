"""Records the flight recorder fixtures of `test_flight.py` from real 2-rank jobs (`fr_job.py`):

python tests/diag/recorded/fr/record.py         # gloo: rewrites skipped/, mismatch/ and missing/ here
python tests/diag/recorded/fr/record.py nccl    # two GPUs: nccl/skipped, nccl/mismatch, nccl/missing,
                                                # the dumps NCCL's watchdog writes at the timeout
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

backend = sys.argv[1] if len(sys.argv) > 1 else "gloo"
if backend not in ("gloo", "nccl"):
    sys.exit(f"record.py: backend {backend!r}: gloo or nccl")
for case in ("skipped", "mismatch", "missing"):
    out = HERE / case if backend == "gloo" else HERE / "nccl" / case
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**os.environ, "FR_CASE": case, "FR_BACKEND": backend, "TORCH_FR_BUFFER_SIZE": "2000"}
    if backend == "nccl":  # as a user switches the dumps on: NCCL's watchdog writes them at the timeout
        prefix = str(out / "nccl_trace_rank_")
        env |= {
            "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
            "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix, "TORCH_FR_DUMP_TEMP_FILE": prefix,
        }  # fmt: skip
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "0"]
    subprocess.run([*torchrun, str(HERE / "fr_job.py"), str(out)], env=env, timeout=120, check=False)
    print(case, sorted(p.name for p in out.iterdir()))
