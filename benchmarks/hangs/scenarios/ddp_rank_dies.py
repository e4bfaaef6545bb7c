"""DDP training on samples parsed from CSV records. At step 4 rank 1 reads a corrupt record ("n/a" in a
feature column) and dies of the ValueError, while rank 0 waits in DDP's gradient all-reduce."""

import datetime
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


def read_records(step: int, rank: int) -> list[str]:
    time.sleep(0.3)  # reading the records from storage
    g = torch.Generator().manual_seed(1000 * rank + step)
    records = [",".join(f"{v:.4f}" for v in row.tolist()) for row in torch.randn(32, 17, generator=g)]
    if rank == 1 and step == 4:
        print(f"FAULT: rank {rank} reads a corrupt record and raises", flush=True)
        fields = records[7].split(",")
        fields[3] = "n/a"  # a hole in the exported table
        records[7] = ",".join(fields)
    return records


def parse(record: str) -> list[float]:
    return [float(v) for v in record.split(",")]


def main() -> None:
    nccl = "--nccl" in sys.argv
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if nccl else torch.device("cpu")
    if nccl:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if nccl else "gloo", timeout=datetime.timedelta(hours=2))
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
    model = DDP(net, device_ids=[device.index] if nccl else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    for step in range(1, 21):
        data = torch.tensor([parse(r) for r in read_records(step, rank)], device=device)
        x, y = data[:, :16], data[:, 16:]
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
