"""Run under `graphdist launch -n 2 --restarts 1`: 8 training steps of SGD with momentum,
a checkpoint every 2 steps into argv[2]; with argv[3] == "kill", worker 1 SIGKILLs itself
before step 5 on the first attempt (GRAPHDIST_RESTART == "0"). Every attempt resumes
from gd.Checkpoint.latest; the chief writes the final weights to argv[1]/final.npz, to be
compared with an uninterrupted run's."""

import os
import signal
import sys

import numpy as np

import graphdist as gd

out_dir, ckpt_dir = sys.argv[1], sys.argv[2]
kill = len(sys.argv) > 3 and sys.argv[3] == "kill"
STEPS, EVERY = 8, 2
gd.config.set_collective_timeout(20.0)
strategy = gd.MultiWorkerMirroredStrategy(["cpu:0"])
with strategy.scope():
    w = gd.Variable(np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3))
    opt = gd.optimizers.SGD(0.1, momentum=0.9)
checkpoint = gd.Checkpoint(w=w, opt=opt)


def replica_fn(x, y):
    with gd.GradientTape() as tape:
        loss = gd.reduce_mean(gd.nn.sparse_softmax_cross_entropy(y, x @ w))
    opt.apply_gradients([(tape.gradient(loss, w), w)])


def batch(step):
    """The global batch of `step`, the same on every worker and every attempt."""
    rng = np.random.default_rng(step)
    return rng.normal(size=(8, 4)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)


train_step = gd.function(lambda x, y: strategy.run(replica_fn, args=(x, y)))
latest = gd.Checkpoint.latest(ckpt_dir)
if latest is not None:
    checkpoint.restore(latest)
done = int(opt.iterations.numpy())
for step in range(done + 1, STEPS + 1):
    if kill and step == 5 and strategy.worker_index == 1 and \
            os.environ.get("GRAPHDIST_RESTART") == "0":
        os.kill(os.getpid(), signal.SIGKILL)
    dist = next(iter(strategy.experimental_distribute_dataset([batch(step)])))
    train_step(*dist)
    if step % EVERY == 0:
        checkpoint.save(os.path.join(ckpt_dir, f"ckpt-{step}.npz"))
if strategy.is_chief:
    np.savez(os.path.join(out_dir, "final.npz"), w=w.numpy(),
             attempt=int(os.environ.get("GRAPHDIST_RESTART", "-1")), resumed_from=done)
