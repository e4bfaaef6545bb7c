"""A job that sleeps: its main thread naps until a line arrives on stdin, while a child process it started
waits for its own line. Neither installs a SIGUSR1 handler (SIGUSR1 would kill them)."""

import subprocess
import sys
import threading
import time

child = subprocess.Popen(
    [sys.executable, "-c", "import sys; sys.stdin.readline(); print('child done', flush=True)"],
    stdin=subprocess.PIPE,
    text=True,
)
stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), name="waker", daemon=True).start()
print("ready", flush=True)
while not stop.is_set():
    time.sleep(0.2)
child.communicate("go\n")
print(f"child exited with {child.returncode}", flush=True)
