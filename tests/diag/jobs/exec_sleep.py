"""A training loop that hands its process over to another program: a few optimizer steps, then
``os.execvp`` into ``sleep`` (as a job script that ends by exec'ing a shell command might)."""

import os

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def main() -> None:
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 4):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step}", flush=True)
    os.execvp("sleep", ["sleep", "600"])


if __name__ == "__main__":
    main()
