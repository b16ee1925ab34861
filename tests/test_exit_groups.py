"""A distributed run's process groups do not outlive it: once Parallel.close() has run and the run's
objects are dropped, the garbage collector frees them, so no gloo group (and none of its transport
and worker threads) is still running while the interpreter finalizes and the process exits (where a
rank once aborted: 'terminate called without an active exception')."""

import subprocess
import sys

SCRIPT = r"""
import gc, os, weakref
import torch, torch.distributed as dist
from torch import nn
from trimtab.config import load_config
from trimtab.distributed.mesh import Mesh
from trimtab.distributed.parallel import Parallel

def gloo_threads():
    names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")]
    return sum(n.startswith(("gloo", "pt_gloo")) for n in names)

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
cfg = load_config(preset="debug").distributed
# two replicas' view over a one-process group: wrap() makes the DDP wrapper with its comm hook
par = Parallel(cfg, torch.device("cpu"), world=2, rank_=0, owns_group=True, mesh=Mesh.of(cfg, 2))
model = nn.Linear(4, 4)
model.hidden = model.forward
ddp = par.wrap(model, compile=False, precision=None)
assert par.ddp is ddp
par.close()
freed = weakref.ref(par)
del par, ddp, model
gc.collect()
print("PARALLEL_FREED", freed() is None)
"""


def test_a_closed_parallel_is_freed_with_its_ddp_wrapper(tmp_path):
    env = {"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    # the reducer (C++) holds the hook's state: Parallel itself would close a cycle the collector cannot see
    assert "PARALLEL_FREED True" in out.stdout, out.stdout + out.stderr[-2000:]
