"""DDP training of a small regressor whose per-sample weights come from shared storage. At step 4 the
read of the weights on rank 1 stalls (an NFS server that stopped answering), so rank 1 never reaches backward
and rank 0 waits for ever in DDP's gradient all-reduce."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def load_batch(step: int, rank: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    time.sleep(0.3)  # reading the batch from storage
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(32, 64, generator=g)
    return x.to(device), x.sum(1, keepdim=True).to(device)


def main() -> None:
    nccl = "--nccl" in sys.argv
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo", timeout=datetime.timedelta(hours=2))
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 1)).to(device)
    model = DDP(net, device_ids=[device.index] if nccl else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(1, 21):
        x, y = load_batch(step, rank, device)
        per_sample = nn.functional.mse_loss(model(x), y, reduction="none")
        if rank == 1 and step == 4:
            print(f"FAULT: rank {rank} sleeps before backward (a slow NFS read)", flush=True)
            time.sleep(3600)  # stands for the read of this step's sample weights: it never comes back
        loss = per_sample.mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
