"""torchrun, NCCL (one GPU per rank; --gloo: on the CPU): each rank's batches come from a prefetch thread.
Rank 1's thread dies at step 3 (an exception in the thread: printed, and nobody joins it), so rank 1 waits
in queue.get() forever, while rank 0 finishes step 3 and waits in the barrier before its checkpoint."""

import os
import queue
import sys
import threading

import torch
import torch.distributed as dist
from torch import nn


def prefetch(batches: "queue.Queue[torch.Tensor]", rank: int, device: torch.device) -> None:
    for step in range(1, 1000):
        if rank == 1 and step == 3:
            raise ConnectionResetError("shard 7: connection reset by peer")
        batches.put(torch.randn(16, 32, device=device))


def main() -> None:
    gloo = "--gloo" in sys.argv
    device = torch.device("cpu") if gloo else torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    if not gloo:
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if gloo else "nccl")
    rank = dist.get_rank()
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    batches: queue.Queue[torch.Tensor] = queue.Queue(maxsize=4)
    threading.Thread(target=prefetch, args=(batches, rank, device), daemon=True).start()
    for step in range(1, 11):
        loss = model(batches.get()).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
        if step % 3 == 0:
            dist.barrier()  # every rank done before rank 0 writes the checkpoint
            if rank == 0:
                torch.save(model.state_dict(), os.devnull)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
