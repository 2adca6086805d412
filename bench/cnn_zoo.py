"""ResNet-50/101, VGG-16 and Inception V3 built with graphdist's layers, for the simulator:
their training steps are traced (shapes and FLOPs), never run. The layer lists follow the
papers (He et al. 2016, table 1; Simonyan & Zisserman 2015, configuration D; Szegedy et al.
2016, figures 5-7 and table 1, as tf.keras.applications builds them), in NHWC and float32,
with the trainable parameters of torchvision's models: 25,557,032 (ResNet-50), 44,549,160
(ResNet-101), 138,357,544 (VGG-16); Inception V3 (no auxiliary head) 23,834,568, tf.keras's
23,817,352 plus the 17,216 batch-norm scales it leaves out.

`builder(name, per_replica)` gives the function of the device count n that `gd.simulate`
and `graphdist simulate` take: a MirroredStrategy over n logical CPU devices, plain SGD (as
tf_cnn_benchmarks and the DDP benchmark), a per-replica batch of `per_replica` images.

    graphdist simulate bench.cnn_zoo:resnet50 --preset dgx1-v100 --devices 1,8,16
"""

from __future__ import annotations

import numpy as np

import graphdist as gd
from graphdist import nn

CLASSES = 1000


def _conv_bn(L, x, filters, kernel, strides=1, padding="same", relu=True):
    """Conv (no bias) + batch norm (+ relu): the unit of ResNet and Inception."""
    y = L(nn.Conv2D, filters, kernel, strides=strides, padding=padding, use_bias=False)(x)
    y = L(nn.BatchNorm, epsilon=1e-3)(y, training=True)
    return gd.relu(y) if relu else y


def _bottleneck(L, x, filters, strides, project):
    """1x1 filters, 3x3 filters (stride here, "v1.5"), 1x1 4*filters, + the shortcut."""
    shortcut = (_conv_bn(L, x, 4 * filters, 1, strides, relu=False) if project else x)
    y = _conv_bn(L, x, filters, 1)
    y = _conv_bn(L, y, filters, 3, strides)
    y = _conv_bn(L, y, 4 * filters, 1, relu=False)
    return gd.relu(y + shortcut)


def resnet_logits(L, x, blocks=(3, 4, 6, 3), width=64, classes=CLASSES):
    """ResNet with bottleneck blocks: (3, 4, 6, 3) is ResNet-50, (3, 4, 23, 3) ResNet-101."""
    y = _conv_bn(L, x, width, 7, 2)
    y = nn.max_pool2d(y, 3, 2, "SAME")
    for stage, count in enumerate(blocks):
        for i in range(count):
            y = _bottleneck(L, y, width * 2**stage, 2 if i == 0 and stage > 0 else 1, i == 0)
    y = gd.reduce_mean(y, axis=(1, 2))
    return L(nn.Dense, classes)(y)


def vgg16_logits(L, x, classes=CLASSES):
    """VGG-16 (configuration D): 13 3x3 convolutions with bias and relu, 5 max pools, and
    fully connected 4096, 4096, classes (dropout left out: it moves no bytes worth pricing)."""
    y = x
    for filters, count in ((64, 2), (128, 2), (256, 3), (512, 3), (512, 3)):
        for _ in range(count):
            y = L(nn.Conv2D, filters, 3, padding="same", activation="relu")(y)
        y = nn.max_pool2d(y, 2, 2, "VALID")
    y = gd.reshape(y, (y.shape[0], -1))
    y = L(nn.Dense, 4096, activation="relu")(y)
    y = L(nn.Dense, 4096, activation="relu")(y)
    return L(nn.Dense, classes)(y)


def _branches(*ys):
    return gd.concat(list(ys), axis=-1)


def _avg_branch(L, x, filters):
    return _conv_bn(L, nn.avg_pool2d(x, 3, 1, "SAME"), filters, 1)


def _inception_a(L, x, pool):
    b1 = _conv_bn(L, x, 64, 1)
    b5 = _conv_bn(L, _conv_bn(L, x, 48, 1), 64, 5)
    b3 = _conv_bn(L, _conv_bn(L, _conv_bn(L, x, 64, 1), 96, 3), 96, 3)
    return _branches(b1, b5, b3, _avg_branch(L, x, pool))


def _inception_b(L, x):          # 35 -> 17
    b3 = _conv_bn(L, x, 384, 3, 2, "valid")
    bd = _conv_bn(L, _conv_bn(L, _conv_bn(L, x, 64, 1), 96, 3), 96, 3, 2, "valid")
    return _branches(b3, bd, nn.max_pool2d(x, 3, 2, "VALID"))


def _inception_c(L, x, c7):
    b1 = _conv_bn(L, x, 192, 1)
    b7 = _conv_bn(L, _conv_bn(L, _conv_bn(L, x, c7, 1), c7, (1, 7)), 192, (7, 1))
    bd = x
    for filters, k in ((c7, 1), (c7, (7, 1)), (c7, (1, 7)), (c7, (7, 1)), (192, (1, 7))):
        bd = _conv_bn(L, bd, filters, k)
    return _branches(b1, b7, bd, _avg_branch(L, x, 192))


def _inception_d(L, x):          # 17 -> 8
    b3 = _conv_bn(L, _conv_bn(L, x, 192, 1), 320, 3, 2, "valid")
    b7 = x
    for filters, k in ((192, 1), (192, (1, 7)), (192, (7, 1))):
        b7 = _conv_bn(L, b7, filters, k)
    b7 = _conv_bn(L, b7, 192, 3, 2, "valid")
    return _branches(b3, b7, nn.max_pool2d(x, 3, 2, "VALID"))


def _inception_e(L, x):
    b1 = _conv_bn(L, x, 320, 1)
    b3 = _conv_bn(L, x, 384, 1)
    b3 = _branches(_conv_bn(L, b3, 384, (1, 3)), _conv_bn(L, b3, 384, (3, 1)))
    bd = _conv_bn(L, _conv_bn(L, x, 448, 1), 384, 3)
    bd = _branches(_conv_bn(L, bd, 384, (1, 3)), _conv_bn(L, bd, 384, (3, 1)))
    return _branches(b1, b3, bd, _avg_branch(L, x, 192))


def inception_v3_logits(L, x, classes=CLASSES):
    """Inception V3 on 299x299 images (no auxiliary head: tf_cnn_benchmarks trains without)."""
    y = _conv_bn(L, x, 32, 3, 2, "valid")
    y = _conv_bn(L, y, 32, 3, padding="valid")
    y = _conv_bn(L, y, 64, 3)
    y = nn.max_pool2d(y, 3, 2, "VALID")
    y = _conv_bn(L, y, 80, 1, padding="valid")
    y = _conv_bn(L, y, 192, 3, padding="valid")
    y = nn.max_pool2d(y, 3, 2, "VALID")
    for pool in (32, 64, 64):
        y = _inception_a(L, y, pool)
    y = _inception_b(L, y)
    for c7 in (128, 160, 160, 192):
        y = _inception_c(L, y, c7)
    y = _inception_d(L, y)
    y = _inception_e(L, _inception_e(L, y))
    y = gd.reduce_mean(y, axis=(1, 2))
    return L(nn.Dense, classes)(y)


MODELS = {  # name: (logits function of (L, images), image side)
    "resnet50": (lambda L, x: resnet_logits(L, x, (3, 4, 6, 3)), 224),
    "resnet101": (lambda L, x: resnet_logits(L, x, (3, 4, 23, 3)), 224),
    "vgg16": (vgg16_logits, 224),
    "inception_v3": (inception_v3_logits, 299),
}


class Layers:
    """The layer maker `L` the logits functions call: L(cls, *args) is the next layer of
    the network, made on the first pass and the same object on every later one, so a
    function written as layers-on-the-fly makes its weights once."""

    def __init__(self, fn):
        self.fn, self.made, self.next = fn, [], 0

    def __call__(self, cls, *args, **kwargs):
        if self.next == len(self.made):
            self.made.append(cls(*args, **kwargs))
        self.next += 1
        return self.made[self.next - 1]

    def logits(self, x):
        self.next = 0
        return self.fn(self, x)

    @property
    def trainable_variables(self) -> list:
        return [v for layer in self.made for v in layer.trainable_variables]

    def parameters(self) -> int:
        return sum(int(np.prod(v.shape)) for v in self.trainable_variables)


def builder(name: str | None, per_replica: int, image: int | None = None, logits=None):
    """builder(n) -> (step, args) for gd.simulate: the model's SGD step on n logical CPU
    devices, `per_replica` images of `image` x `image` x 3 each (zeros: only shapes count).
    `logits`: a function (L, images) -> logits instead of a named model's."""
    fn, side = MODELS[name] if logits is None else (logits, image)
    side = image or side

    def build(n: int):
        strategy = gd.MirroredStrategy([f"cpu:{i}" for i in range(n)])
        net = Layers(fn)
        with strategy.scope():
            opt = gd.optimizers.SGD(0.1)
            # the weights, made by a trace of one image (shapes only: nothing runs)
            gd.function(net.logits).get_graph(np.zeros((1, side, side, 3), np.float32))

        @gd.function
        def step(batch):
            def replica_fn(x, y):
                with gd.GradientTape() as tape:
                    loss = gd.reduce_mean(nn.sparse_softmax_cross_entropy(y, net.logits(x)))
                variables = net.trainable_variables
                opt.apply_gradients(zip(tape.gradient(loss, variables), variables))
                return loss
            return strategy.reduce(gd.ReduceOp.MEAN, strategy.run(replica_fn, args=batch))

        images = np.zeros((per_replica * n, side, side, 3), np.float32)
        labels = np.zeros(per_replica * n, np.int32)
        batch = next(iter(strategy.experimental_distribute_dataset([(images, labels)])))
        return step, (batch,)

    return build


def resnet50(n: int):
    """ResNet-50, 32 images per replica (the DDP benchmark's batch)."""
    return builder("resnet50", 32)(n)
