"""A DataLoader whose samples take 1.5 s each to read (a slow network filesystem), two workers."""

import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class RemoteSamples(Dataset):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(1.5)  # fetching the sample from a slow store
        g = torch.Generator().manual_seed(index)
        return torch.randn(16, generator=g), torch.randn(1, generator=g)


def main() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(RemoteSamples(), batch_size=4, num_workers=2)
    for step, (x, y) in enumerate(loader, start=1):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    print("epoch done", flush=True)


if __name__ == "__main__":
    main()
