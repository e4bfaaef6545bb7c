"""Deadlocks at step 3 in backward (a gradient-statistics hook takes a lock it already holds) while its
DataLoader's two worker processes sit idle, waiting for the next indices."""

import threading

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

stats_lock = threading.Lock()
grad_norms: list[float] = []
step = 0


def summarize() -> None:
    with stats_lock:  # already held by the hook below: waits forever
        print("mean grad norm", sum(grad_norms) / len(grad_norms))


def record_grad(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
    with stats_lock:
        grad_norms.append(float(grad_output[0].norm()))
        if step % 3 == 0:
            summarize()


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum(dim=-1)


def main() -> None:
    global step
    model = Net()
    model.layers[1].register_full_backward_hook(record_grad)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(256, 16))
    loader = DataLoader(data, batch_size=8, num_workers=2, persistent_workers=True)
    for step, (x,) in enumerate(loader, start=1):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} done", flush=True)


if __name__ == "__main__":
    main()
