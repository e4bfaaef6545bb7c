"""A job stuck on a lock: its main thread waits for a lock that another thread holds until a line arrives
on stdin (a stand-in for a lock that is never released). It registers faulthandler for SIGUSR1 itself, as
many training scripts do, so `kill -USR1` prints its threads' stacks to stderr."""

import faulthandler
import signal
import sys
import threading

faulthandler.register(signal.SIGUSR1, all_threads=True)

lock = threading.Lock()
lock.acquire()


def release_when_told() -> None:
    sys.stdin.readline()
    lock.release()


threading.Thread(target=release_when_told, name="releaser", daemon=True).start()
print(f"step 1 loss {sum(i * i for i in range(1000)) / 1e6:.4f}", flush=True)
print("ready", flush=True)
lock.acquire()  # step 2 waits here
print("step 2 done", flush=True)
