"""Mlp: the Python twin of memlean::models::Mlp (the Swish blog post's reference network,
Linear(in -> hidden) -> Swish -> Linear(hidden -> out); docs/sources.md); same parameter
names."""
import torch

from experiments.models.shared import check_segments, make_activation, parse_segments, run_stages


class Mlp(torch.nn.Module):
    """fc1 -> activation -> fc2. checkpoint: 'none', 'memlean' (the hidden layer, = segments:2)
    or 'segments:K' (K <= 2)."""

    def __init__(self, in_features=128, hidden_features=1 << 20, out_features=1,
                 activation="memory_efficient", checkpoint="none"):
        super().__init__()
        self.fc1 = torch.nn.Linear(in_features, hidden_features)
        self.act = make_activation(activation)
        self.fc2 = torch.nn.Linear(hidden_features, out_features)
        mode, k = parse_segments(checkpoint)
        if mode == "memlean":
            mode, k = "segments", 2
        check_segments(k, 2, "Mlp")
        self.mode, self.k = mode, k
        # A plain list (not registered twice) of modules (no closure over self: a model in a
        # reference cycle would keep its parameters until the garbage collector runs).
        self._stages = [torch.nn.Sequential(self.fc1, self.act), self.fc2]

    def forward(self, x):
        if x.dim() != 2:
            x = x.flatten(1)
        return run_stages(self._stages, self.mode, self.k, x)
