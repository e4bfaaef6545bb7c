"""Two ranks (torchrun --nproc-per-node 2, gloo) stuck at step 2: rank 0 waits in all_reduce for rank 1,
with its progress thread busy-waiting beside it (100% CPU: NCCL spins in its collective, gloo waits in a
futex), while rank 1 is blocked on an event that a line on stdin sets. After the line rank 1 joins the
all_reduce and both finish. Each rank registers faulthandler for SIGUSR1."""

import faulthandler
import signal
import sys
import threading

import torch
import torch.distributed as dist

faulthandler.register(signal.SIGUSR1, all_threads=True)

dist.init_process_group("gloo")
rank = dist.get_rank()
grad = torch.ones(4)
dist.all_reduce(grad)
print(f"rank {rank} step 1 done", flush=True)
finished = False


def report_progress() -> None:
    """Busy-waits for the step to finish (instead of a Condition)."""
    while not finished:
        pass


if rank == 0:
    threading.Thread(target=report_progress, name="progress", daemon=True).start()
    print("rank 0 ready", flush=True)
    dist.all_reduce(grad)  # step 2: waits for rank 1
else:
    go = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), go.set()), name="stdin", daemon=True).start()
    print("rank 1 ready", flush=True)
    go.wait()
    dist.all_reduce(grad)
finished = True
print(f"rank {rank} step 2 done: {grad.tolist()}", flush=True)
dist.destroy_process_group()
