"""CNNs through torch.compile(backend="ember") against eager: a ResNet-style and a
MobileNet-style classifier (eval mode, random weights and batch norm statistics)."""

import torch
from conftest import check, rand
from ember.models import MobileNet, ResNet

# Many layers of convolutions summed in another order than torch's kernels.
TOL = {"rtol": 1e-4, "atol": 1e-4}


def test_resnet(backend):
    model = ResNet(widths=(8, 16), classes=5)
    check(model, [rand(2, 3, 16, 16)], backend, **TOL, new_inputs=[rand(2, 3, 16, 16)])


def test_mobilenet(backend):
    model = MobileNet(classes=5)
    check(model, [rand(2, 3, 24, 24)], backend, **TOL)


def test_resnet_features_match_before_the_head(backend):
    model = ResNet(widths=(8, 16), classes=5).eval()
    check(lambda x: model.blocks(model.stem(x)), [rand(1, 3, 12, 10)], backend, **TOL)


def test_resnet_new_batch_size():
    model = ResNet(widths=(8,), classes=3)
    compiled = check(model, [rand(1, 3, 8, 8)], "cpu", **TOL)
    x = rand(3, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), **TOL)
