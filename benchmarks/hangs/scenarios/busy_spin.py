"""Trains a small MLP; every 4 steps an eval thread scores the model and sets a flag.
The eval thread crashes on a shape error, and the loop spins on the flag at 100% CPU for ever."""
import threading
import time

import torch
import torch.nn as nn

eval_ready = False
eval_score = None

model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
val_x = torch.randn(512, 20)


def run_eval(snapshot, n_features):
    global eval_ready, eval_score
    with torch.no_grad():
        eval_score = snapshot(val_x[:, :n_features]).argmax(1).float().mean().item()
    eval_ready = True


for step in range(1, 41):
    x, y = torch.randn(64, 20), torch.randint(0, 2, (64,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    if step % 4 == 0:
        eval_ready = False
        n_features = 20 if step < 8 else 16  # feature pruning kicks in at step 8
        threading.Thread(target=run_eval, args=(model, n_features), name="evaluator").start()
        if step == 8:
            time.sleep(0.1)
            print("FAULT: spinning on a flag that the crashed eval thread never sets", flush=True)
        while not eval_ready: pass
        print(f"step {step} eval {eval_score:.3f}", flush=True)
    time.sleep(0.3)
print("done", flush=True)
