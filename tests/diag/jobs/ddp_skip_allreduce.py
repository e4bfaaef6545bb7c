"""torchrun, gloo (--nccl: NCCL on one GPU per rank): gradients averaged by hand with all_reduce; rank 1
skips it at step 3 (it thinks its batch was empty) and goes on to a barrier, while rank 0 waits in the
all_reduce."""

import os
import sys

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    nccl = "--nccl" in sys.argv
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 6):
        model(torch.randn(4, 8, device=device)).sum().backward()
        empty_batch = rank == 1 and step == 3
        if not empty_batch:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        else:
            dist.barrier()
        opt.step()
        opt.zero_grad()
        if nccl:
            torch.cuda.synchronize()  # NCCL returns at once: wait here, as a loss.item() would
        print(f"rank {rank} step {step}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
