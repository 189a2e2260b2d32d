"""cudagen's PyTorch frontend: a torch.nn.Module in, a cudagen TaskGraph out.

    import cudagen_torch
    cudagen_torch.export(model, (torch.randn(1, 3, 64, 64),), "model/")

writes model/graph.json (the cudagen.taskgraph/1 format) and one .npy file per
parameter and buffer, named by the module's own names (model/layers.0.fc.weight.npy).
Then `cudagen run model/graph.json --emulate` (or the C++ runtime) runs it.
docs/torch-frontend.md has the mapping table.
"""

from .exporter import ExportError, ExportResult, dropout_mask, export, from_numpy, supported_targets, to_numpy

__all__ = ["export", "ExportError", "ExportResult", "supported_targets", "to_numpy", "from_numpy", "dropout_mask"]
