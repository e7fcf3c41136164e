"""The layers of a pipeline stage, in forward order, as the activation meter and the per-layer
record name them (``find_layers``), and the stage's chunks (``chunks_of``). No hooks, no torch
state: a walk of the modules."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import nn

from .composition import modules_of

#: The ``kind`` of a layer in the record: a transformer layer, Megatron's embedding and output
#: layer, the items of a repeated container, and everything else on the stage.
KINDS = ("layer", "embedding", "output", "other")


@dataclass(frozen=True)
class Layer:
    """One layer of a stage: its name within its chunk, kind (KINDS), chunk index and module
    (None for "other"); ``number`` is Megatron's global 1-based layer number where it has one."""

    name: str
    kind: str
    chunk: int
    module: nn.Module | None
    number: int | None = None


def chunks_of(model: nn.Module | Sequence[nn.Module] | None) -> list[nn.Module]:
    """The stage's chunks: ``model`` itself, or the items of Megatron's list of chunks."""
    return [m for m in modules_of(model) if isinstance(m, nn.Module)]


def find_layers(model: nn.Module | Sequence[nn.Module] | None) -> list[Layer]:
    """The stage's layers, in forward order, then one "other" entry per stage for the rest.

    Megatron (a chunk that is, or wraps through ``.module``, a model with ``decoder.layers``): its
    embedding, its transformer layers, its output layer, where this stage has them. Any other
    model: the items of its shallowest ``Sequential`` or ``ModuleList`` of one class of module
    (the transformer blocks), else of its largest one."""
    found = []
    for index, chunk in enumerate(chunks_of(model)):
        inner = _unwrapped(chunk)
        decoder_layers = getattr(getattr(inner, "decoder", None), "layers", None)
        if isinstance(decoder_layers, nn.ModuleList):
            embedding = getattr(inner, "embedding", None)
            if isinstance(embedding, nn.Module):
                found.append(Layer("embedding", "embedding", index, embedding))
            for i, layer in enumerate(decoder_layers):
                number = getattr(layer, "layer_number", None)
                found.append(Layer(f"decoder.layers.{i}", "layer", index, layer, number))
            output = getattr(inner, "output_layer", None)
            if isinstance(output, nn.Module):
                found.append(Layer("output_layer", "output", index, output))
            continue
        name, container = _repeated(inner)
        prefix = f"{name}." if name else ""
        found += [Layer(f"{prefix}{i}", "layer", index, item) for i, item in enumerate(container)]
    found.append(Layer("other", "other", -1, None))
    return found


def _unwrapped(module: nn.Module) -> nn.Module:
    """Through DDP / Float16Module-style wrappers (``.module``) to the model."""
    inner = getattr(module, "module", None)
    while isinstance(inner, nn.Module):
        module, inner = inner, getattr(inner, "module", None)
    return module


def _repeated(module: nn.Module) -> tuple[str, list]:
    """(name, items) of the shallowest Sequential/ModuleList of items of one class (the largest such
    at that depth); failing that, the largest of two or more items of any kind; else ("", [])."""
    same, mixed = [], []
    for name, child in nn.Module.named_modules(module):
        if isinstance(child, (nn.Sequential, nn.ModuleList)) and len(child):
            items = list(child)
            entry = (name.count(".") + bool(name), -len(items), name, items)
            if len({type(item) for item in items}) == 1:
                same.append(entry)
            elif len(items) >= 2:
                mixed.append(entry)
    best = min(same, default=None) or min(mixed, key=lambda entry: entry[1], default=None)
    return (best[2], best[3]) if best else ("", [])
