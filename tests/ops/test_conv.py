"""Convolutions (1/2/3-d, stride, padding incl. 'same'/'valid', dilation, groups,
depthwise, transposed), pooling (max/avg with ceil_mode, count_include_pad, dilation;
adaptive avg/max), interpolate (nearest, linear, bilinear, trilinear and bicubic, with and
without align_corners), grid sampling, pad modes, and the norms CNNs use (eval batch norm,
group norm, instance norm)."""

import pytest
import torch
import torch.nn.functional as F
from conftest import Fn, check, ember, rand
from torch import nn

# Convolutions sum up to a few hundred f32 products in another order than torch's kernels.
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.mark.parametrize(
    "conv",
    [
        nn.Conv2d(3, 8, 3, stride=2, padding=1),
        nn.Conv2d(4, 6, (3, 2), stride=(1, 2), padding=(2, 1), dilation=(2, 3), groups=2),
        nn.Conv2d(6, 12, 3, padding=1, groups=6, bias=False),  # depthwise, multiplier 2
        nn.Conv2d(5, 7, 1),  # pointwise
        nn.Conv2d(3, 4, 4, padding="same"),  # even kernel: asymmetric 'same'
        nn.Conv2d(3, 4, 3, padding="valid", dilation=2),
    ],
    ids=["strided", "grouped_dilated", "depthwise", "pointwise", "same_even", "valid"],
)
def test_conv2d(conv, backend):
    check(conv, [rand(2, conv.in_channels, 11, 9)], backend, **TOL)


def test_conv1d_and_conv3d(backend):
    c1 = nn.Conv1d(3, 5, 4, stride=3, padding=2, dilation=2)
    c1s = nn.Conv1d(3, 4, 3, padding="same")
    c3 = nn.Conv3d(2, 3, (2, 3, 2), stride=(1, 2, 1), padding=1, groups=1)
    check(
        lambda a, b: (c1(a), c1s(a), c3(b)),
        [rand(2, 3, 13), rand(1, 2, 5, 6, 4)],
        backend,
        **TOL,
    )


def test_conv_noncontiguous_input(backend):
    conv = nn.Conv2d(3, 4, 3, padding=1)
    check(lambda x: conv(x.permute(0, 3, 1, 2)), [rand(2, 7, 6, 3)], backend, **TOL)


@pytest.mark.parametrize(
    "conv",
    [
        nn.ConvTranspose2d(4, 3, 3, stride=2, padding=1, output_padding=1),
        nn.ConvTranspose2d(4, 6, (2, 3), stride=(2, 1), groups=2, dilation=(1, 2)),
        nn.ConvTranspose2d(2, 3, 3, stride=1, padding=2, bias=False),  # padding > kernel reach
    ],
    ids=["strided", "grouped", "cropping"],
)
def test_conv_transpose2d(conv, backend):
    check(conv, [rand(2, conv.in_channels, 5, 6)], backend, **TOL)


def test_batch_norm_eval_folds_into_conv(backend):
    conv, bn = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6).eval()
    bn.running_mean.uniform_(-1, 1)
    bn.running_var.uniform_(0.5, 2)
    bn.weight.data.uniform_(-2, 2)
    bn.bias.data.uniform_(-1, 1)
    bn1 = nn.BatchNorm1d(3).eval()
    check(
        lambda x, y: (bn(conv(x)), bn(x.repeat(1, 2, 1, 1)), bn1(y)),
        [rand(2, 3, 7, 5), rand(4, 3, 6)],
        backend,
        **TOL,
    )


def test_group_and_instance_norm(backend):
    gn = nn.GroupNorm(3, 6)  # (modules in a lambda are not put in eval mode by check)
    gn.weight.data.uniform_(-2, 2)
    inorm = nn.InstanceNorm2d(6, affine=True)
    inorm_plain = nn.InstanceNorm1d(4)
    check(
        lambda x, y: (gn(x), inorm(x), inorm_plain(y)),
        [rand(2, 6, 5, 4) * 10 + 3, rand(3, 4, 9)],
        backend,
        **TOL,
    )


@pytest.mark.parametrize("ceil_mode", [False, True])
def test_max_pool(ceil_mode, backend):
    check(
        lambda x, y, z, w: (
            F.max_pool2d(x, 3, 2, 1, ceil_mode=ceil_mode),
            F.max_pool2d(x, (3, 2), (2, 1), (1, 0), dilation=(2, 1), ceil_mode=ceil_mode),
            F.max_pool1d(y, 4, 3, 2, ceil_mode=ceil_mode),
            F.max_pool3d(z, 2, ceil_mode=ceil_mode),
            # Wide rows: most outputs take the vectorized interior path, every phase used.
            F.max_pool1d(w, 5, 3, 2, dilation=2, ceil_mode=ceil_mode),
            F.max_pool2d(w.unsqueeze(2), (1, 3), (1, 2), (0, 1), ceil_mode=ceil_mode),
        ),
        [rand(2, 3, 9, 8), rand(2, 3, 13), rand(1, 2, 5, 6, 7), rand(2, 3, 71)],
        backend,
    )


def test_max_pool_nan_wins_in_every_window_it_is_in(backend):
    # Max pooling reduces the window's input rows first and then slides along that row: a
    # NaN in either step (first, middle or last tap) must reach every window holding it.
    # Rows of 40 span several 16-lane vectors of outputs (stride 1) and of inputs (stride 2).
    x = rand(2, 3, 9, 8)
    x[0, 0, 0, 0] = x[0, 1, 4, 3] = x[1, 2, 8, 7] = x[1, 0, 5, 0] = float("nan")
    wide = rand(2, 3, 7, 40)
    wide[0, 0, 0, 0] = wide[0, 1, 3, 17] = wide[1, 2, 6, 39] = wide[1, 0, 2, 32] = float("nan")
    check(
        lambda x, wide: (
            F.max_pool2d(x, 3, 2, 1),
            F.max_pool2d(x, 2, 1, dilation=2),
            F.max_pool2d(wide, 3, 2, 1),
            F.max_pool2d(wide, 3, 1, 1),
            F.max_pool2d(wide, 2, 2, ceil_mode=True),
        ),
        [x, wide],
        backend,
    )


@pytest.mark.parametrize("ceil_mode", [False, True])
@pytest.mark.parametrize("count_include_pad", [False, True])
def test_avg_pool(ceil_mode, count_include_pad, backend):
    kw = {"ceil_mode": ceil_mode, "count_include_pad": count_include_pad}
    check(
        lambda x, y, z: (
            F.avg_pool2d(x, 3, 2, 1, **kw),
            F.avg_pool2d(x, (2, 3), (2, 2), (1, 0), divisor_override=4, **kw),
            F.avg_pool1d(y, 3, 2, 1, **kw),
            F.avg_pool3d(z, 2, 2, 1, **kw),
        ),
        [rand(2, 3, 9, 8), rand(2, 3, 11), rand(1, 2, 5, 6, 7)],
        backend,
        **TOL,
    )


def test_adaptive_pooling(backend):
    check(
        lambda x: (
            F.adaptive_avg_pool2d(x, 1),
            F.adaptive_avg_pool2d(x, (3, 4)),  # divisible: one pooling window size
            F.adaptive_avg_pool2d(x, (4, 3)),  # uneven, overlapping bins
            F.adaptive_max_pool2d(x, (5, 3)),
            F.adaptive_avg_pool1d(x.flatten(2), 7),
            F.adaptive_max_pool1d(x.flatten(2), 5),
        ),
        [rand(2, 3, 9, 8)],
        backend,
        **TOL,
    )


@pytest.mark.parametrize("mode", ["bilinear", "bicubic"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_bilinear_and_bicubic(mode, align_corners, backend):
    # Bicubic taps past the edges are clamped (a negative source position reads the first
    # pixel).
    ac = {"mode": mode, "align_corners": align_corners}
    check(
        lambda x: (
            F.interpolate(x, scale_factor=2, **ac),
            F.interpolate(x, size=(7, 11), **ac),
            F.interpolate(x, size=(3, 2), **ac),  # downsampling
            F.interpolate(x, scale_factor=(1.5, 0.75), **ac),
        ),
        [rand(2, 3, 5, 6)],
        backend,
        **TOL,
    )


def test_nearest(backend):
    check(
        lambda x, y, z: (
            F.interpolate(x, scale_factor=2, mode="nearest"),
            F.interpolate(x, size=(7, 4), mode="nearest"),
            F.interpolate(x, scale_factor=(1.5, 0.5), mode="nearest"),
            F.interpolate(y, scale_factor=3, mode="nearest"),
            F.interpolate(z, size=(3, 4, 5), mode="nearest"),
            nn.Upsample(scale_factor=2)(x),
            F.interpolate(x, size=(7, 4), mode="nearest-exact"),
            F.interpolate(y, scale_factor=2.5, mode="nearest-exact"),
        ),
        [rand(2, 3, 5, 6), rand(2, 3, 4), rand(1, 2, 2, 3, 4)],
        backend,
    )


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate"])
def test_pad_modes(mode, backend):
    kw = {"value": 1.5} if mode == "constant" else {}
    check(
        lambda x, y: (F.pad(x, (1, 2, 2, 0), mode=mode, **kw), F.pad(y, (2, 1), mode=mode, **kw)),
        [rand(2, 3, 5, 6), rand(2, 3, 7)],
        backend,
    )


def test_cnn_activations(backend):
    check(
        lambda x: (F.relu6(x), F.hardswish(x), F.hardsigmoid(x), F.hardtanh(x, -2, 1.5)),
        [rand(2, 3, 4, 5) * 3],
        backend,
    )


@pytest.mark.parametrize("align_corners", [False, True])
def test_linear_and_trilinear(align_corners, backend):
    check(
        lambda x, y: (
            F.interpolate(x, scale_factor=2.5, mode="linear", align_corners=align_corners),
            F.interpolate(x, size=4, mode="linear", align_corners=align_corners),
            F.interpolate(y, size=(4, 6, 5), mode="trilinear", align_corners=align_corners),
            F.interpolate(
                y, scale_factor=(2, 0.5, 1), mode="trilinear", align_corners=align_corners
            ),
        ),
        [rand(2, 3, 9), rand(1, 2, 3, 4, 4)],
        backend,
        **TOL,
    )


@pytest.mark.parametrize("padding_mode", ["zeros", "border", "reflection"])
@pytest.mark.parametrize("align_corners", [False, True])
def test_grid_sample(padding_mode, align_corners, backend):
    # Positions past the edges (the grid spans [-1.3, 1.3]) read the padding.
    kw = {"padding_mode": padding_mode, "align_corners": align_corners}
    check(
        lambda x, grid: (
            F.grid_sample(x, grid, mode="bilinear", **kw),
            F.grid_sample(x, grid, mode="nearest", **kw),
        ),
        [rand(2, 3, 5, 7), (torch.rand(2, 4, 6, 2) * 2.6 - 1.3)],
        backend,
        **TOL,
    )


def test_bicubic_grid_sample_is_named():
    def f(x, grid):
        return F.grid_sample(x, grid, mode="bicubic", align_corners=False)

    with pytest.raises(ember.UnsupportedOpError, match="grid_sampler_2d"):
        ember.compile(Fn(f), rand(1, 2, 4, 4), rand(1, 3, 3, 2), fallback="error")


def test_unsupported_interpolation_is_named():
    def f(x):
        return F.interpolate(x, scale_factor=2, mode="bilinear", antialias=True)

    with pytest.raises(ember.UnsupportedOpError, match="upsample_bilinear2d_aa"):
        ember.compile(Fn(f), rand(1, 2, 4, 4), fallback="error")


def test_grouped_conv_batch_and_pointwise_packed_weights(backend):
    # Weights packed per group at compile time; several images split across threads; a
    # 1×1 conv reads the input as its column matrix.
    model = nn.Sequential(
        nn.Conv2d(8, 24, 3, padding=1, groups=2),
        nn.ReLU(),
        nn.Conv2d(24, 17, 1),
        nn.Conv2d(17, 9, (3, 5), stride=2),
    )
    check(model, [rand(3, 8, 19, 23)], backend, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("batch", [1, 3])
def test_conv_im2col_written_in_gemm_panels(batch, backend):
    # f32 convs with a packed weight write im2col straight into the GEMM's panel layout: one
    # image gives its threads to im2col chunks (40 channels) and the product; output planes
    # that are not a multiple of the 16-column panel (13×11, 7×6) leave a zero-padded tail,
    # and padding, stride and dilation put zeros inside the panels.
    model = nn.Sequential(
        nn.Conv2d(40, 24, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(24, 20, (3, 2), stride=2, padding=(1, 2), dilation=(1, 2)),
    )
    check(model, [rand(batch, 40, 13, 11)], backend, **TOL)


class _ResidualBlock(nn.Module):
    """conv → BN → ReLU → conv → BN, plus the input, ReLU: the shape of a ResNet block,
    whose epilogues (bias, ReLU, residual add) run on each image's outputs inside the conv."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        self.a = nn.Conv2d(channels, channels, 3, padding=dilation, dilation=dilation)
        self.bn_a = nn.BatchNorm2d(channels)
        self.b = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn_b = nn.BatchNorm2d(channels)
        for bn in (self.bn_a, self.bn_b):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)

    def forward(self, x):
        y = F.relu(self.bn_a(self.a(x)))
        return F.relu(x + self.bn_b(self.b(y)))


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize(
    "width,dilation", [(16, 1), (12, 2), (7, 1), (33, 1)], ids=["w16", "w12_dil2", "w7", "w33"]
)
def test_conv_shifted_rows_with_fused_epilogue(batch, width, dilation, backend):
    # f32 convs whose output rows fill most of 8-lane vectors read a padded copy of the input
    # tap by tap (no im2col); rows of 7, 12 and 33 leave partial vectors, 13 channels a
    # partial panel of output channels. A strided conv reads the copy split into phases.
    block = _ResidualBlock(13, dilation).eval()
    down = nn.Conv2d(13, 10, 3, stride=2, padding=1).eval()
    check(
        lambda x: (block(x), down(block(x))),
        [rand(batch, 13, 9, width)],
        backend,
        **TOL,
    )


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("size", [8, 7, 3])
def test_conv_channel_lanes_on_small_planes(batch, size, backend):
    # On AVX-512 CPUs, f32 convs with a multiple of 64 output channels on small static
    # planes put output channels along the vector lanes (weights packed k × channels, the
    # result stored transposed); 192 input channels span several slices of the weight, a
    # grouped conv packs each group's 64 channels apart, a strided one reads phases.
    block = _ResidualBlock(64, 1).eval()
    wide = nn.Conv2d(64, 192, 3, padding=1).eval()
    deep = nn.Conv2d(192, 64, 3, padding=1, bias=False).eval()
    grouped = nn.Conv2d(128, 128, 3, padding=1, groups=2).eval()
    down = nn.Conv2d(64, 128, 3, stride=2, padding=1).eval()
    check(
        lambda x: (deep(F.relu(wide(block(x)))), grouped(torch.cat([x, x * 0.5], 1)), down(x)),
        [rand(batch, 64, size, size)],
        backend,
        **TOL,
    )


@pytest.mark.parametrize("batch", [1, 3])
def test_conv_relu_clamped_in_the_kernel(batch, backend):
    # A ReLU right after a conv is applied to the sums in registers by the panel kernels
    # (flat and channel lanes on AVX-512, shifted rows on AVX2) instead of a pass over the
    # output; NaNs must stay NaN through it, as through the unfused ReLU. One image runs the
    # kernel on every thread, several split images over threads.
    stem = nn.Conv2d(3, 32, 3, padding=1).eval()
    down = nn.Conv2d(32, 64, 3, stride=2, padding=1, bias=False).eval()
    lanes = nn.Conv2d(64, 64, 3, padding=1).eval()
    x = rand(batch, 3, 20, 20)
    x[0, 1, 5, 7] = float("nan")
    check(
        lambda x: (F.relu(stem(x)), F.relu(lanes(F.relu(down(F.relu(stem(x))))))),
        [x],
        backend,
        **TOL,
    )


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("width", [16, 12, 21])
def test_conv_residual_add_and_relu_in_the_kernel(batch, width, backend):
    # A residual block's `relu(conv(x) + bias + skip)`: on AVX2 the shifted-row kernel adds
    # the skip to its sums before the clamp (rows of 12 and 21 end in part-filled vectors).
    # With and without a bias, the skip on either side of the add, a stride-2 conv with a
    # projected skip, and a broadcast skip (not fused: must still match).
    c1 = nn.Conv2d(16, 16, 3, padding=1).eval()
    c2 = nn.Conv2d(16, 16, 3, padding=1, bias=False).eval()
    down = nn.Conv2d(16, 24, 3, stride=2, padding=1).eval()
    proj = nn.Conv2d(16, 24, 1, stride=2).eval()
    x = rand(batch, 16, 10, width)
    x[0, 3, 4, 5] = float("nan")
    row = rand(width)

    def block(x):
        a = F.relu(c1(x) + x)
        b = F.relu(x + c2(a))
        c = F.relu(down(b) + proj(b))
        d = F.relu(c1(a) + row)
        return a, b, c, d

    check(block, [x], backend, **TOL)


def test_conv_shifted_rows_in_one_and_three_dims(backend):
    c1 = nn.Conv1d(6, 9, 5, stride=2, padding=2)
    c3 = nn.Conv3d(3, 8, 3, padding=1)
    check(
        lambda a, b: (F.relu(c1(a)), c3(b) * 2.0),
        [rand(2, 6, 37), rand(2, 3, 4, 5, 16)],
        backend,
        **TOL,
    )


@pytest.mark.parametrize("size", [1, 2, 3, 6])
def test_kernels_wider_than_the_input(size, backend):
    """ConvNeXt's 7×7 depthwise convs (padding 3) meet 2×2 maps in the last stage: taps that
    read only padding along a row must be skipped, on every conv path (depthwise direct,
    im2col into GEMM panels, shifted rows, strided, transposed) and in pooling."""
    convs = [
        nn.Conv2d(8, 8, 7, padding=3, groups=8),
        nn.Conv2d(8, 16, 7, padding=3),
        nn.Conv2d(8, 6, 5, stride=2, padding=2),
        nn.Conv2d(8, 5, 3, padding=2, dilation=2),
        nn.Conv1d(8, 8, 9, padding=4, groups=8),
        nn.ConvTranspose2d(8, 4, 5, padding=1),
    ]
    pool = nn.MaxPool2d(5, stride=1, padding=2)
    avg = nn.AvgPool2d(5, stride=1, padding=2, count_include_pad=False)

    def fn(x):
        outs = [c(x[..., 0, :]) if isinstance(c, nn.Conv1d) else c(x) for c in convs]
        return (*outs, pool(x), avg(x))

    check(fn, [rand(2, 8, size, size)], backend, **TOL)
