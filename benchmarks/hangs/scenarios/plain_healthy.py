"""Trains a small classifier for 40 steps on a synthetic TensorDataset through a DataLoader
with two worker processes, logging every step. Healthy: it finishes and exits 0."""
import logging
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

logging.basicConfig(stream=sys.stdout, level=logging.INFO,
                    format="%(asctime)s %(levelname)s %(message)s")
log = logging.getLogger("train")


def main():
    torch.manual_seed(0)
    xs = torch.randn(40 * 64, 30)
    ys = (xs[:, :3].sum(1) > 0).long()
    loader = DataLoader(TensorDataset(xs, ys), batch_size=64, shuffle=True, num_workers=2)
    model = nn.Sequential(nn.Linear(30, 128), nn.ReLU(), nn.Linear(128, 2))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step, (x, y) in enumerate(loader, start=1):
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        acc = (model(x).argmax(1) == y).float().mean().item()
        log.info("step %d loss %.4f acc %.3f", step, loss.item(), acc)
        time.sleep(0.3)
    log.info("training finished after %d steps", step)


if __name__ == "__main__":
    main()
