"""Stuck at step 3 in backward: a gradient-statistics hook waits for a lock that the metrics thread holds
while its flush hangs (a stand-in: it waits for a line on stdin), and the DataLoader's two worker
processes sit idle, waiting for the next indices. It registers faulthandler for SIGUSR1 (its DataLoader
workers, forked, inherit the handler)."""

import faulthandler
import signal
import sys
import threading

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

faulthandler.register(signal.SIGUSR1, all_threads=True)

stats_lock = threading.Lock()
grad_norms: list[float] = []


def flush_metrics(started: threading.Event) -> None:
    with stats_lock:
        started.set()
        print("ready", flush=True)
        sys.stdin.readline()  # the flush that hangs
        print(f"flushed {len(grad_norms)} gradient norms", flush=True)


def record_grad(module: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
    with stats_lock:
        grad_norms.append(float(grad_output[0].norm()))


class Net(nn.Module):
    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum(dim=-1)


def main() -> None:
    model = Net()
    model.layers[1].register_full_backward_hook(record_grad)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.randn(32, 16))
    loader = DataLoader(data, batch_size=8, num_workers=2, persistent_workers=True)
    for step, (x,) in enumerate(loader, start=1):
        if step == 3:
            started = threading.Event()
            threading.Thread(target=flush_metrics, args=(started,), name="metrics", daemon=True).start()
            started.wait()
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print(f"step {step} done", flush=True)


if __name__ == "__main__":
    main()
