"""A training loop that runs its evaluation as a separate program every few steps (`subprocess.run`, as
many scripts call an eval harness) and waits for it; the evaluation never finishes: it waits in a loop
for a result file that nothing writes."""

import logging
import subprocess
import sys

import torch
from torch import nn

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
log = logging.getLogger("train")
EVAL = """
import os, time
while not os.path.exists("/nonexistent/eval-results.json"):
    time.sleep(0.5)
"""


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 7):
        x, y = torch.randn(16, 32), torch.randn(16, 1)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        log.info("step %d loss %.4f", step, loss.item())
        if step % 3 == 0:
            subprocess.run([sys.executable, "-c", EVAL], check=True)
            log.info("evaluated at step %d", step)


if __name__ == "__main__":
    main()
