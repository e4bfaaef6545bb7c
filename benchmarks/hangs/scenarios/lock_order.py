"""Trains a small MLP while a background thread snapshots the weights to disk.
The checkpoint thread takes the two locks in the opposite order to the training loop: deadlock."""
import tempfile
import threading
import time

import torch
import torch.nn as nn

metrics_lock = threading.Lock()   # guards the running metrics
state_lock = threading.Lock()     # guards model/optimizer state while saving
save_requested = threading.Event()
metrics = {"loss": 0.0, "step": 0}
ckpt_dir = tempfile.mkdtemp(prefix="ckpt-")

model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05)


def checkpoint_saver():
    while True:
        save_requested.wait()
        save_requested.clear()
        with state_lock:
            sd = {k: v.clone() for k, v in model.state_dict().items()}
            time.sleep(0.5)  # serialising takes a while
            with metrics_lock:
                sd["meta"] = dict(metrics)
        torch.save(sd, f"{ckpt_dir}/last.pt")


threading.Thread(target=checkpoint_saver, name="checkpoint-saver", daemon=True).start()

for step in range(1, 101):
    x, y = torch.randn(128, 64), torch.randint(0, 10, (128,))
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    with metrics_lock:
        metrics["loss"], metrics["step"] = loss.item(), step
        if step % 4 == 0:
            save_requested.set()
            time.sleep(0.2)  # flush the metrics line to the log
            print("FAULT: checkpoint thread takes the locks in the other order", flush=True)
            with state_lock:
                opt.step()
        else:
            with state_lock:
                opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    time.sleep(0.3)
print("done", flush=True)
