"""A training loop that, after step 3, runs an external program on its data and waits for it
(subprocess.run), as users call a tokenizer binary, tar or zstd, or a compiler building an extension: here
a shell loop that works at full CPU for --tool-s seconds. --stuck: the program waits for ever instead (a
tool blocked on a lock or a dead mount, here a sleep), so subprocess.run never returns."""

import argparse
import subprocess

import torch
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tool-s", type=int, default=8)
    parser.add_argument("--stuck", action="store_true")
    args = parser.parse_args()
    model = nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(1, 6):
        model(torch.randn(16, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        if step == 3:
            work = f"timeout {args.tool_s} sh -c 'while :; do :; done'; exit 0"
            subprocess.run(["sh", "-c", "sleep 3600" if args.stuck else work], check=True)
        print(f"step {step}", flush=True)


if __name__ == "__main__":
    main()
