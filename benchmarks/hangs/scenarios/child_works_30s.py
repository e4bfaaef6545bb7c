"""Trains a small MLP; after step 5 it runs the external offline-eval tool (a shell job that
keeps one core busy for about 30 s) and waits for it, then trains a few more steps and exits. Healthy."""
import os
import subprocess
import tempfile
import time

import torch
import torch.nn as nn

work = tempfile.mkdtemp(prefix="job-")
EVAL_TOOL = r"""
end=$(( $(date +%s) + 30 ))
rounds=0
while [ "$(date +%s)" -lt "$end" ]; do
  i=0; while [ $i -lt 50000 ]; do i=$((i + 1)); done
  rounds=$((rounds + 1))
done
echo "offline eval: $rounds rounds" > "$OUT"
"""

model = nn.Sequential(nn.Linear(40, 160), nn.ReLU(), nn.Linear(160, 40))
opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for step in range(1, 13):
    x = torch.randn(256, 40)
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}", flush=True)
    if step == 5:
        ckpt = os.path.join(work, "step5.pt")
        torch.save(model.state_dict(), ckpt)
        print("running offline eval on", ckpt, flush=True)
        t0 = time.time()
        out = os.path.join(work, "eval.txt")
        subprocess.run(["sh", "-c", EVAL_TOOL], check=True, env={**os.environ, "OUT": out})
        with open(out) as f:
            print(f.read().strip(), f"({time.time() - t0:.1f} s)", flush=True)
    time.sleep(0.3)
print("done", flush=True)
