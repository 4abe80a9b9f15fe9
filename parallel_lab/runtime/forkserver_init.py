"""Imported once, by the forkserver `launch` starts (its first preload), never by the lab itself.

The server's parent is the notebook kernel. Asking the Linux kernel to kill the server when its
parent dies (PR_SET_PDEATHSIG) makes it die with the notebook even while ranks hold its "alive"
pipe open (CPython's multiprocessing/forkserver.py: every child holds one end, so the server would
otherwise wait for them); each rank, in turn, dies with the server (the same signal, set in
`launch._worker`) and watches the kernel through a pidfd as a second line.
"""

from __future__ import annotations

from parallel_lab.runtime.launch import _die_with_parent

_die_with_parent()
