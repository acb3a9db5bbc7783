"""torch's shared-memory manager (the `file_system` sharing strategy's), started once per process before the
DataLoader workers fork, so every worker of every epoch and eval uses it rather than starting one of its own (which
took 1-2 s of each worker's first batch on the 2-core CPU VM).

The workers hand batches over by name (`file_system`), not by descriptor: the default strategy has the main process ask
the worker for each batch's descriptor over a socket when it receives the batch, a round trip that waits for the worker
to be scheduled, on the training step's time.

Starting the manager (a process that loads libtorch, about 0.3-0.8 s on the 2-core VM) through torch
(`Tensor.share_memory_`) holds the interpreter until the manager answers, so the process's other threads stop too:
the downloads of the first shards (train.data.loader.stage_first) waited for it. `ready` asks libshm for it through
ctypes, which lets go of the interpreter for the call, so those downloads go on meanwhile; where that call is not
available (a torch without the symbol, not Linux) it is torch's own call, as before."""

from __future__ import annotations

import ctypes
import functools
import os

import torch

STRATEGY = "file_system"
# libshm's THManagedMapAllocatorInit(const char* manager_handle, const char* filename): with an empty handle it starts
# this process's default manager when there is none (libshm/core.cpp), then registers `filename` with it
_INIT = "_ZN25THManagedMapAllocatorInitC1EPKcS1_"
_OBJECT = ctypes.create_string_buffer(256)  # the object it constructs (a std::string): kept, never destroyed


def _libshm_init():
    """libshm's constructor as a ctypes function (called without the interpreter held), or None."""
    folder = os.path.dirname(torch.__file__)
    manager = os.path.join(folder, "bin", "torch_shm_manager")
    if not (os.name == "posix" and os.access(manager, os.X_OK)):
        return None  # a manager that cannot start would raise a C++ error through ctypes: torch's own call says why
    try:
        fn = getattr(ctypes.CDLL(os.path.join(folder, "lib", "libshm.so")), _INIT)
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = None, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
    return fn


@functools.cache
def ready() -> None:
    """This process's manager started, before workers fork (once per process); the sharing strategy set."""
    torch.multiprocessing.set_sharing_strategy(STRATEGY)
    if (fn := _libshm_init()) is not None:
        # a name never created: the manager's clean-up of it at exit finds nothing to remove
        fn(_OBJECT, b"", f"/theworld_{os.getpid()}_{id(_OBJECT):x}".encode())
    torch.empty(1, dtype=torch.uint8).share_memory_()  # with the manager started above: one request to it, ~1 ms
