"""A 2-rank gloo job that goes wrong at its fourth all_reduce, written as users write DDP loops; each rank
dumps its flight recorder (``torch._C._distributed_c10d._dump_fr_trace``) where the job ends, as NCCL's
``TORCH_NCCL_DUMP_ON_TIMEOUT`` would. ``FR_CASE``: ``skipped`` (rank 1 stops calling collectives: stuck in
its data), ``mismatch`` (rank 1 broadcasts where rank 0 all-reduces), ``missing`` (as skipped, and rank 1
dies before it can dump). Run by ``record.py`` (torchrun, TORCH_FR_BUFFER_SIZE set)."""

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
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=3))
    rank = dist.get_rank()
    stats = dist.new_group([0, 1], group_desc="stats")
    dist.all_gather_into_tensor(torch.empty(2), torch.ones(1), group=stats)  # the loss logging group
    grads = torch.ones(4096)
    try:
        for step in range(6):
            if rank == 1 and step == 3:
                if case == "mismatch":
                    dist.broadcast(torch.ones(16), src=0)  # a rank-dependent branch takes another path
                else:
                    time.sleep(5)  # stuck in its batch: never calls the step's all-reduce
                    if case == "missing":
                        os._exit(1)  # killed before any dump
                    break
            train_step(grads, None)
    except RuntimeError as exc:
        print(f"rank {rank}: {str(exc).splitlines()[0][:120]}", flush=True)
    data = torch._C._distributed_c10d._dump_fr_trace()
    with open(os.path.join(out, f"gloo_trace_rank_{rank}"), "wb") as f:
        f.write(data)
    os._exit(0)


if __name__ == "__main__":
    main()
