"""Long, healthy run: fits a tiny linear model for many fast optimizer steps (a few ms each), logging every 1,000 steps.
Healthy: it runs for several minutes with steady progress and exits 0."""
import argparse
import logging
import sys
import time

import torch
import torch.nn as nn

log = logging.getLogger("train")
ACCUM = 16  # effective batch 128


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100000)
    args = parser.parse_args()
    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")

    torch.manual_seed(0)
    torch.set_num_threads(1)
    target = nn.Linear(16, 16)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=args.steps)

    t_start = time.time()
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        for _ in range(ACCUM):  # gradient accumulation over micro-batches of 8
            x = torch.randn(8, 16)
            with torch.no_grad():
                y = target(x)
            loss = nn.functional.mse_loss(model(x), y) / ACCUM
            loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 1000 == 0:
            elapsed = time.time() - t_start
            log.info("step %d/%d loss %.5f lr %.2e (%.2f ms/step, %.0fs elapsed)",
                     step, args.steps, ACCUM * loss.item(), sched.get_last_lr()[0], 1000 * elapsed / step, elapsed)
            sys.stdout.flush()
    log.info("done: %d steps in %.0fs", args.steps, time.time() - t_start)


if __name__ == "__main__":
    main()
