"""A job whose GPU kernel runs for a long time (CUDA): it launches one kernel that spins for SECONDS
(argv[1], default 15) and waits for it in torch.cuda.synchronize(). It registers faulthandler for SIGUSR1."""

import faulthandler
import signal
import sys
import time

import torch

faulthandler.register(signal.SIGUSR1, all_threads=True)

seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 15.0
torch.cuda._sleep(1000)  # warm-up: context and module load
torch.cuda.synchronize()
cycles = 10**8
start = time.perf_counter()
torch.cuda._sleep(cycles)
torch.cuda.synchronize()
per_cycle = (time.perf_counter() - start) / cycles
print("ready", flush=True)
torch.cuda._sleep(int(seconds / per_cycle))
torch.cuda.synchronize()
print("done", flush=True)
