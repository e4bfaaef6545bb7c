"""A training loop whose DataLoader worker is killed by the kernel (SIGKILL, as the OOM killer does) while
it reads a sample; torch raises in the main process."""

import os
import signal

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Shards(Dataset):
    def __len__(self):
        return 256

    def __getitem__(self, i):
        if i == 100:  # a huge sample blows the worker's memory: the kernel kills it
            os.kill(os.getpid(), signal.SIGKILL)
        return torch.randn(16), torch.randn(1)


model = nn.Linear(16, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step, (x, y) in enumerate(DataLoader(Shards(), batch_size=8, num_workers=2)):
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
