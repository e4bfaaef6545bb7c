"""A 2-rank job that goes wrong at its fourth all_reduce, written as users write DDP loops. ``FR_CASE``:
``skipped`` (rank 1 stops calling collectives: stuck in its data), ``mismatch`` (rank 1 broadcasts where
rank 0 all-reduces), ``missing`` (as skipped, and rank 1 dies before it can dump). Run by ``record.py``.

``FR_BACKEND=gloo`` (the default): each rank dumps its flight recorder
(``torch._C._distributed_c10d._dump_fr_trace``) where the job ends, as NCCL's ``TORCH_NCCL_DUMP_ON_TIMEOUT``
would. ``FR_BACKEND=nccl`` (two GPUs): the tensors on ``cuda:<rank>``, and NCCL's own watchdog writes the
dumps at the collective's timeout (``record.py`` sets ``TORCH_NCCL_DUMP_ON_TIMEOUT`` and the file prefix),
as a user's job leaves them; the job does not dump by itself."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist


def train_step(x, group):
    dist.all_reduce(x)  # the gradients' all-reduce of a hand-written data-parallel loop
    return x / dist.get_world_size()


def main():
    case, out = os.environ["FR_CASE"], sys.argv[1]
    backend = os.environ.get("FR_BACKEND", "gloo")
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=3))
    stats = dist.new_group([0, 1], group_desc="stats")
    logged = torch.empty(2, device=device)
    dist.all_gather_into_tensor(logged, torch.ones(1, device=device), group=stats)  # the loss logging group
    grads = torch.ones(4096, device=device)
    try:
        for step in range(6):
            if rank == 1 and step == 3:
                if case == "mismatch":
                    dist.broadcast(torch.ones(16, device=device), src=0)  # a rank-dependent branch
                else:
                    time.sleep(5)  # stuck in its batch: never calls the step's all-reduce
                    if case == "missing":
                        os._exit(1)  # killed before any dump
                    break
            train_step(grads, None)
        if backend == "nccl":
            torch.cuda.synchronize()  # NCCL's calls return at once: the hang is here, until its watchdog
    except RuntimeError as exc:
        print(f"rank {rank}: {str(exc).splitlines()[0][:120]}", flush=True)
    if backend == "nccl":
        time.sleep(30)  # the watchdog dumps and aborts the process; a rank it spares stays to be dumped
        os._exit(0)
    data = torch._C._distributed_c10d._dump_fr_trace()
    with open(os.path.join(out, f"gloo_trace_rank_{rank}"), "wb") as f:
        f.write(data)
    os._exit(0)


if __name__ == "__main__":
    main()
