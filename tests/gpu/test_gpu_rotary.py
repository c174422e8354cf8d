"""Rotary embeddings: queries and keys rotated in one stacked pass equal the separate rotation
bit for bit (the attention block stacks them when the model has no q/k norm)."""

from __future__ import annotations

import torch

from ringserve.gpu.layers.rotary import RotaryEmbedding, rope_parameters


def test_stacked_rotation_equals_separate_rotation_bitwise() -> None:
    rotary = RotaryEmbedding(16, 128, rope_parameters({"rope_theta": 10000.0}))
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 5, 127, 64])
    q, k = torch.randn(4, 4, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    q_sep, k_sep = rotary.forward(positions, q, k)
    both = rotary.rotate(positions, torch.cat((q, k), dim=1))
    assert torch.equal(both[:, :4], q_sep) and torch.equal(both[:, 4:], k_sep)
    # the textbook formula (transformers' rotate_half form)
    angle = positions[:, None].float() * rotary.cos_sin.new_tensor(
        [10000.0 ** (-i / 16) for i in range(0, 16, 2)])[None, :]
    cos, sin = torch.cat((angle, angle), -1).cos()[:, None], torch.cat((angle, angle), -1).sin()[:, None]
    rotated = torch.cat((-q[..., 8:], q[..., :8]), -1)
    torch.testing.assert_close(q_sep, q * cos + rotated * sin, atol=1e-5, rtol=1e-5)
