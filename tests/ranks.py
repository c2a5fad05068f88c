"""Two processes for one test, forked from a server that imported torch, transformers and adept_ext
once (`multiprocessing`'s forkserver, preloaded when this module is imported): a process starts in a
fraction of a second instead of importing them again (about 4 s each on 2 cores). A plain fork of the
test process is not used: it can inherit a busy thread pool and hang. The processes see the
environment the server started with (conftest.py's), not a variable a test sets after it started."""
import multiprocessing

import torch.multiprocessing as mp

multiprocessing.get_context("forkserver").set_forkserver_preload(
    ["torch", "transformers", "adept_ext", "adept_ext.train", "adept_ext.continual", "tiny_models"])


def spawn(fn, args=(), nprocs: int = 2, join: bool = True):
    """`torch.multiprocessing.spawn`'s call (fn(rank, *args) in `nprocs` processes; join=False returns
    their context at once), its processes forked from the preloaded server."""
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")
