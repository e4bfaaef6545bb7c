"""A training loop with torch.compile, as users write it; prints the graph breaks Dynamo counted.
--device cuda: the same on the GPU (`make gpu-smoke`, with inductor)."""

import argparse
import os

import torch
from torch import nn


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = Net().to(args.device)
    compiled = torch.compile(model, backend=os.environ.get("COMPILE_BACKEND", "inductor"))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 6):
        x, y = torch.randn(8, 16, device=args.device), torch.randn(8, 1, device=args.device)
        loss = nn.functional.mse_loss(compiled(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} loss {loss.item():.4f}", flush=True)
    from torch._dynamo.utils import counters

    print(f"graph breaks {sum(counters['graph_break'].values())}")


if __name__ == "__main__":
    main()
