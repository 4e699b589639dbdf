"""The toy model, data set and metric that toy_config.py names (registered with mmengine)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, METRICS, MODELS
from torch import nn


@DATASETS.register_module()
class ToyClassification(torch.utils.data.Dataset):
    """A fixed, in-memory 4-class problem: 8 features, labels from a hidden linear map."""

    def __init__(self, size: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(size, 8, generator=g)
        self.y = (self.x @ torch.randn(8, 4, generator=g)).argmax(-1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"inputs": self.x[i], "labels": self.y[i]}


@MODELS.register_module()
class ToyNet(BaseModel):
    """A BaseModel: forward(inputs, labels, mode) with mode 'loss' / 'predict' / 'tensor'."""

    def __init__(self, hidden: int = 64, data_preprocessor: dict | None = None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        self.backbone = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, hidden))
        self.head = nn.Linear(hidden, 4)

    def forward(self, inputs, labels=None, mode="tensor"):
        logits = self.head(torch.relu(self.backbone(inputs)))
        if mode == "loss":
            return {"loss_cls": F.cross_entropy(logits, labels)}
        if mode == "predict":
            return list(zip(logits.argmax(-1), labels, strict=True))
        return logits


@METRICS.register_module()
class ToyAccuracy(BaseMetric):
    def process(self, data_batch, data_samples):
        self.results.extend(float(p == t) for p, t in data_samples)

    def compute_metrics(self, results):
        return {"accuracy": sum(results) / max(len(results), 1)}
