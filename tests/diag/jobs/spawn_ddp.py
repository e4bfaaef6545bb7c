"""DDP started with torch.multiprocessing.spawn (no torchrun), gloo, as many single-node scripts do; each
process learns its rank from spawn's index. At step 4 something goes wrong on one rank:

--fault mismatch  rank 0 alone all-reduces a metric: its 4 bytes meet rank 1's next gradient bucket, and
                  gloo aborts rank 0 ("Is there a distributed collective mismatch in your code?")
--fault stuck     rank 1's data source never answers (a queue nothing fills): rank 0 waits in DDP's
                  all-reduce in backward
--fault raise     rank 1 finds a corrupt shard and raises: spawn stops rank 0
"""

import argparse
import os
import queue

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def worker(rank: int, world: int, fault: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(rank)
    model = DDP(nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    batches: queue.Queue[torch.Tensor] = queue.Queue()
    for step in range(1, 9):
        if fault == "stuck" and rank == 1 and step == 4:
            x = batches.get()  # the loader thread that fills it died
        elif fault == "raise" and rank == 1 and step == 4:
            raise RuntimeError("corrupt shard 17")
        else:
            x = torch.randn(8, 16)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if fault == "mismatch" and rank == 0 and step == 4:
            metric = loss.detach().reshape(1)
            dist.all_reduce(metric)  # only rank 0 reduces its metric: rank 1 never joins
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fault", choices=["mismatch", "stuck", "raise"], required=True)
    args = parser.parse_args()
    mp.spawn(worker, args=(2, args.fault), nprocs=2)
