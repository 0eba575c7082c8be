"""CNNs through torch.compile(backend="ember") against eager: a ResNet-style and a
MobileNet-style classifier (eval mode, random weights and batch norm statistics)."""

import torch
from conftest import check, rand
from ember.backend import programs_compiled
from ember.models import MobileNet, ResNet

# Many layers of convolutions summed in another order than torch's kernels.
TOL = {"rtol": 1e-4, "atol": 1e-4}


def test_resnet(backend):
    model = ResNet(widths=(8, 16), classes=5)
    check(model, [rand(2, 3, 16, 16)], backend, **TOL, new_inputs=[rand(2, 3, 16, 16)])


def test_mobilenet(backend):
    model = MobileNet(classes=5)
    check(model, [rand(2, 3, 16, 16)], backend, **TOL)


def test_resnet_dynamic_batch_compiles_once():
    model = ResNet(widths=(8,), classes=3).eval()
    compiled = torch.compile(model, backend="ember", options={"fallback": "error"})
    before = programs_compiled()
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = rand(batch, 3, 12, 12)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), **TOL)
    assert programs_compiled() - before == 1
