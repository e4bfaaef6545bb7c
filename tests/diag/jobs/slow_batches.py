"""A DataLoader whose samples take about 1.5 s each to read from a slow network filesystem (1.5 MiB a
sample, read in 64 KiB pieces at about 1 MiB/s: --mib-per-s), two workers."""

import argparse
import os
import tempfile
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

SAMPLE_BYTES = 3 << 19  # 1.5 MiB
PIECE_S = 0.06  # a 64 KiB piece at about 1 MiB/s


class RemoteSamples(Dataset):
    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        with open(os.path.join(self.folder, f"sample{index}.bin"), "rb", buffering=0) as f:
            while f.read(64 << 10):  # the store serves about 1 MiB/s
                time.sleep(PIECE_S)
        g = torch.Generator().manual_seed(index)
        return torch.randn(16, generator=g), torch.randn(1, generator=g)


def main() -> None:
    global PIECE_S
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib-per-s", type=float, default=1.0)
    PIECE_S = 0.06 / parser.parse_args().mib_per_s
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    folder = tempfile.mkdtemp(prefix="remote-")
    for index in range(12):
        with open(os.path.join(folder, f"sample{index}.bin"), "wb") as f:
            f.write(os.urandom(SAMPLE_BYTES))
    loader = DataLoader(RemoteSamples(folder), batch_size=4, num_workers=2)
    for step, (x, y) in enumerate(loader, start=1):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    print("epoch done", flush=True)


if __name__ == "__main__":
    main()
