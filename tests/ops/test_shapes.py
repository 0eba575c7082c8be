"""Views and data movement: view/reshape/permute/transpose/expand/(un)squeeze/flatten,
slicing with steps, select/narrow, cat/stack/split/chunk, flip, pad, repeat, as_strided."""

import pytest
import torch
import torch.nn.functional as F
from conftest import check, rand

SHAPE_OPS = {
    "view": lambda x: x.view(6, 4) * 2,
    "reshape_infer": lambda x: x.reshape(-1, 4) + 1,
    "permute": lambda x: x.permute(2, 0, 1) * 1,
    "transpose": lambda x: x.transpose(0, 2).contiguous() + 0,
    "expand": lambda x: x[:, :1].expand(5, 2, 3, 4) * 1,
    "unsqueeze_squeeze": lambda x: x.unsqueeze(1).squeeze(1).unsqueeze(-1) + 0,
    "flatten": lambda x: torch.flatten(x, 1) * 1,
    "slice_step": lambda x: x[:, 1::2, ::3] + 0,
    "slice_negative": lambda x: x[-2:, :-1] * 1,
    "select": lambda x: (x[1] * 2, x[:, -1, 2] + 1),
    "narrow": lambda x: x.narrow(1, 1, 2) + 0,
    "flip": lambda x: torch.flip(x, (0, 2)) + 0,
    "view_of_transpose": lambda x: x.transpose(1, 2).reshape(2, -1) * 1,
    "repeat": lambda x: x.repeat(2, 1, 1) + 0,
    "cat": lambda x: torch.cat([x, x * 2], dim=1),
    "cat_neg_dim": lambda x: torch.cat([x, x[..., :2]], dim=-1),
    "stack": lambda x: torch.stack([x, x + 1], dim=1),
    "split": lambda x: [t * 1 for t in x.split(2, dim=2)],
    "split_sizes": lambda x: [t + 0 for t in x.split([1, 3], dim=2)],
    "chunk": lambda x: [t * 1 for t in x.chunk(2, dim=1)],
    "unbind": lambda x: [t + 0 for t in x.unbind(0)],
    "pad": lambda x: F.pad(x, (1, 2, 0, 1), value=0.5),
    "pad_crop": lambda x: F.pad(x, (-1, 1)),
    # as_strided of a computed (contiguous) value: a restride of size-1 dims is a reshape;
    # overlapping windows, a transpose and an offset read are gathers.
    "as_strided_size1": lambda x: (
        torch.as_strided(x.sum(2, keepdim=True), (2, 3, 1), (3, 1, 9)) * 2
    ),
    "as_strided_windows": lambda x: torch.as_strided(x * 2, (11, 4), (2, 1)) + 1,
    "as_strided_transpose": lambda x: torch.as_strided(x + 1, (4, 6), (1, 4)) * 1,
    "as_strided_offset": lambda x: torch.as_strided(x * 1, (2, 2, 3), (12, 4, 1), 5) + 0,
    "adaptive_avg_pool1d": lambda x: F.adaptive_avg_pool1d(x, 1) * 2,
}


@pytest.mark.parametrize("name", sorted(SHAPE_OPS))
def test_shape_op(name, backend):
    check(SHAPE_OPS[name], [rand(2, 3, 4)], backend, new_inputs=[rand(2, 3, 4)])


def test_view_of_larger_input():
    # view(6, 20) needs 120 elements.
    check(lambda x: x.view(6, 20) * 2, [rand(2, 3, 20)])


def test_noncontiguous_input_views(backend):
    x = rand(4, 6).t()  # a transposed, non-contiguous input
    check(lambda x: (x.reshape(-1) * 1, x[::2] + 1, x.permute(1, 0) * 2), [x], backend)


def test_expanded_input(backend):
    x = rand(1, 5).expand(3, 5)  # stride-0 input
    check(lambda x: x * 2 + x.sum(0), [x], backend)


def test_zero_sized_and_scalar(backend):
    check(lambda x, s: (x * 2, x.sum(1), s + 1, s * x.sum()), [rand(0, 3), rand()], backend)
