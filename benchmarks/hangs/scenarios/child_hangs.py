"""Trains a small MLP and every 2 steps syncs the latest checkpoint to a backup folder with a shell tool.
One sync waits for ever on the backup mount (a FIFO nobody writes), and subprocess.run has no timeout."""
import os
import subprocess
import tempfile
import time

import torch
import torch.nn as nn

work = tempfile.mkdtemp(prefix="job-")
ckpt = os.path.join(work, "last.pt")
backup = os.path.join(work, "backup")
os.makedirs(backup)
lock_fifo = os.path.join(work, "backup.lock")
os.mkfifo(lock_fifo)  # the backup daemon answers on this FIFO when the mount is ready

model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 32))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
for step in range(1, 41):
    x = torch.randn(256, 32)
    loss = (model(x) - x.flip(1)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    if step % 2 == 0:
        torch.save(model.state_dict(), ckpt)
        # from step 6 on the backup is "remote" and the tool first waits for the mount
        remote = "cat $LOCK >/dev/null; " if step >= 6 else ""
        if step == 6:
            print("FAULT: the checkpoint sync tool waits for ever on the backup mount", flush=True)
        subprocess.run(["sh", "-c", remote + "cp \"$SRC\" \"$DST\"/ && sync"], check=True,
                       env={**os.environ, "LOCK": lock_fifo, "SRC": ckpt, "DST": backup})
    time.sleep(0.3)
print("done", flush=True)
