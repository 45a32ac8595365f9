"""Convolutional VQ-VAE encoder and decoder (the common CIFAR-10 recipe of van den Oord et al. / sonnet).

Default shapes: images ``(B, 3, 32, 32)`` -> latents ``(B, D, 8, 8)`` -> images ``(B, 3, 32, 32)``: two stride-2
4x4 convolutions, a 3x3 convolution and a stack of residual blocks down; a 3x3 convolution, residual blocks and
two stride-2 4x4 transposed convolutions up.
"""

from __future__ import annotations

from torch import Tensor, nn

from softvq._checks import check_non_negative_int, check_positive_int


class ResidualBlock(nn.Module):
    """``x + conv1x1(relu(conv3x3(relu(x))))`` with a narrow ``hidden`` bottleneck."""

    def __init__(self, channels: int, hidden: int) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(channels, hidden, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(hidden, channels, kernel_size=1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.block(x)


class ResidualStack(nn.Sequential):
    """``num_blocks`` residual blocks followed by a ReLU (as in the VQ-VAE paper)."""

    def __init__(self, channels: int, hidden: int, num_blocks: int) -> None:
        super().__init__(*[ResidualBlock(channels, hidden) for _ in range(num_blocks)], nn.ReLU())


def _check_config(width: int, res_hidden: int, res_blocks: int, downsamples: int, code_dim: int) -> None:
    check_positive_int("width", width)
    check_positive_int("res_hidden", res_hidden)
    check_positive_int("code_dim", code_dim)
    check_non_negative_int("res_blocks", res_blocks)
    check_positive_int("downsamples", downsamples)
    if width % 2:
        raise ValueError(f"width must be even (the first layer has width // 2 channels), got {width}")


class Encoder(nn.Module):
    """Images ``(B, C, H, W)`` -> pre-quantization latents ``(B, code_dim, H / 2^downsamples, W / 2^downsamples)``.

    Args:
        in_channels: image channels.
        width: channels of the convolutional trunk (the first stride-2 layer has ``width // 2``).
        res_hidden: channels inside each residual block.
        res_blocks: number of residual blocks.
        downsamples: number of stride-2 4x4 convolutions (2: 32x32 -> 8x8).
        code_dim: ``D``, channels of the latent (the quantizer's token dimension).
    """

    def __init__(self, in_channels: int = 3, width: int = 128, res_hidden: int = 32, res_blocks: int = 2,
                 downsamples: int = 2, code_dim: int = 64) -> None:
        super().__init__()
        _check_config(width, res_hidden, res_blocks, downsamples, code_dim)
        layers: list[nn.Module] = []
        channels = check_positive_int("in_channels", in_channels)
        for i in range(downsamples):
            out = width // 2 if i == 0 and downsamples > 1 else width
            layers += [nn.Conv2d(channels, out, kernel_size=4, stride=2, padding=1), nn.ReLU()]
            channels = out
        layers += [nn.Conv2d(channels, width, kernel_size=3, padding=1), ResidualStack(width, res_hidden, res_blocks),
                   nn.Conv2d(width, code_dim, kernel_size=1)]
        self.net = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)


class Decoder(nn.Module):
    """Latents ``(B, code_dim, h, w)`` -> images ``(B, out_channels, h * 2^upsamples, w * 2^upsamples)``.

    Mirrors :class:`Encoder`; the arguments mean the same (``upsamples`` = the encoder's ``downsamples``).
    """

    def __init__(self, out_channels: int = 3, width: int = 128, res_hidden: int = 32, res_blocks: int = 2,
                 upsamples: int = 2, code_dim: int = 64) -> None:
        super().__init__()
        _check_config(width, res_hidden, res_blocks, upsamples, code_dim)
        check_positive_int("out_channels", out_channels)
        layers: list[nn.Module] = [nn.Conv2d(code_dim, width, kernel_size=3, padding=1),
                                   ResidualStack(width, res_hidden, res_blocks)]
        channels = width
        for i in range(upsamples):
            last = i == upsamples - 1
            out = out_channels if last else (width // 2 if i == upsamples - 2 else width)
            layers.append(nn.ConvTranspose2d(channels, out, kernel_size=4, stride=2, padding=1))
            if not last:
                layers.append(nn.ReLU())
            channels = out
        self.net = nn.Sequential(*layers)

    def forward(self, z: Tensor) -> Tensor:
        return self.net(z)
