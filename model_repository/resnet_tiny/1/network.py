"""The network served by resnet_tiny, importable by model.py and by tests.

A ResNet-style classifier for 3x32x32 images: a stem, three stages of two residual
blocks (16, 32, 64 channels), global average pooling and a linear head; ~0.2 M parameters.
Weights come from `weights.pt` beside this file when present (a state_dict saved with
torch.save), else they are initialised deterministically from `seed`.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = nn.Sequential()
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return torch.relu(y + self.short(x))


class ResNetTiny(nn.Module):
    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.head(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def build(seed: int = 0, weights: Path | None = None) -> ResNetTiny:
    """The network in eval mode, with weights from `weights` if that file exists, else from `seed`."""
    gen_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    net = ResNetTiny()
    torch.random.set_rng_state(gen_state)
    if weights is not None and Path(weights).exists():
        net.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    return net.eval()
