"""A job busy in Python: it spins in a loop until a line arrives on stdin, then prints its result. It
registers faulthandler for SIGUSR1 itself."""

import faulthandler
import signal
import sys
import threading

faulthandler.register(signal.SIGUSR1, all_threads=True)

stop = threading.Event()
threading.Thread(target=lambda: (sys.stdin.readline(), stop.set()), name="stopper", daemon=True).start()
print("ready", flush=True)
state = 1
while not stop.is_set():
    state = (state * 31 + 7) % 1_000_003
print("done", flush=True)
