"""A DataLoader with two worker processes; reading sample 9 blocks forever (a stuck network read)."""

import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Samples(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        if index == 9:
            time.sleep(3600)  # the read that never returns
        return torch.full((8,), float(index))


def main() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Samples(), batch_size=4, num_workers=2)
    for step, batch in enumerate(loader, start=1):
        model(batch).sum().backward()
        opt.step()
        opt.zero_grad()
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    main()
