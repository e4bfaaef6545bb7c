"""A plain training loop whose Dataset raises on one corrupt record in a DataLoader worker (two workers):
torch re-raises it in the main process as "Caught ValueError in DataLoader worker process 0." with the
original traceback in its message."""

import logging

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger("train")


class Shards(Dataset):
    def __len__(self):
        return 400

    def __getitem__(self, i):
        if i == 137:
            raise ValueError(f"sample {i}: corrupt record (expected 16 floats, got 3)")
        return torch.randn(16), torch.randn(1)


def main():
    logging.basicConfig(level=logging.INFO)
    loader = DataLoader(Shards(), batch_size=16, num_workers=2)
    model = nn.Linear(16, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step, (x, y) in enumerate(loader, 1):
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.info("step %d loss %.3f", step, loss.item())


if __name__ == "__main__":
    main()
