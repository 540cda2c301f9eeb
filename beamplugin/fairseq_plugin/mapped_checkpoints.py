"""Load checkpoints for decoding by mapping their files: the model's weights are the file's
pages, not a copy of them.

fairseq's loading reads the whole checkpoint into memory and then copies it into a model it
has just initialised: two copies of every weight at once (6.1 GB for a 2.5 GB NLLB-600M-shaped
checkpoint). When a model is loaded to decode (``checkpoint_utils.load_model_ensemble_and_task``:
fairseq-generate, fairseq-interactive, beamplugin-serve, beamplugin-translate) its checkpoint
is mapped instead (``torch.load(mmap=True)``) and each float32 tensor becomes the model's
parameter in place (``assign``): the initialised weights are freed, and the file's pages are
read only where something reads them; the model is built without drawing random weights that
the checkpoint's replace. Once our kernels carry a weight in their own layout, its
pages are handed back (beamplugin.runtime.pages; beamplugin.models.transformer_weights).
Mapped files are checked as every checkpoint is (beamplugin.fairseq_plugin.checkpoint_safety).

Parameters the model ties together (shared embeddings) stay one parameter. A checkpoint in
another precision (float16), an old non-zip file, a remote path and fairseq-train's loads
(which go on to write the weights) load as fairseq loads them. The file must not be rewritten in
place while a process decodes from it (fairseq's own saves write a new file and rename it);
``BEAMPLUGIN_MMAP=0`` turns mapping off.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import os
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from fairseq import checkpoint_utils
from fairseq.dataclass.utils import overwrite_args_by_name
from fairseq.file_io import PathManager
from omegaconf import OmegaConf
from torch import nn
from torch.overrides import TorchFunctionMode

from beamplugin.fairseq_plugin.checkpoint_safety import check_checkpoint

# set while checkpoint_utils.load_model_ensemble_and_task runs (a load to decode)
_DECODING_LOAD = contextvars.ContextVar("decoding_load", default=False)


def mapping_enabled() -> bool:
    """Whether loads to decode map checkpoints (``BEAMPLUGIN_MMAP`` unset or not ``0``)."""
    return os.environ.get("BEAMPLUGIN_MMAP", "1") != "0"


def maps(path: str) -> bool:
    """Whether :func:`load_mapped` maps ``path``: a local zip checkpoint (torch.save's format
    since torch 1.6), read in a load to decode, mapping enabled."""
    return (
        _DECODING_LOAD.get()
        and mapping_enabled()
        and PathManager.get_local_path(path) == path
        and zipfile.is_zipfile(path)
    )


def load_mapped(path: str, arg_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """fairseq's ``load_checkpoint_to_cpu`` (the overrides, the configuration, the upgrades),
    with the tensors mapped from the file and the model's float32 tensors marked to become its
    parameters in place."""
    check_checkpoint(path)
    state = torch.load(path, map_location="cpu", mmap=True)
    if state.get("args") is not None and arg_overrides is not None:
        for name, value in arg_overrides.items():
            setattr(state["args"], name, value)
    if state.get("cfg") is not None:
        state["cfg"] = OmegaConf.create(state["cfg"], flags={"allow_objects": True})
        if arg_overrides is not None:
            overwrite_args_by_name(state["cfg"], arg_overrides)
    state = checkpoint_utils._upgrade_state_dict(state)
    if isinstance(state.get("model"), dict):
        state["model"] = _assigned_in_place(state["model"])
    return state


def _assigned_in_place(weights: dict[str, Any]) -> OrderedDict[str, Any]:
    """``weights`` with torch's per-module ``assign_to_params_buffers`` metadata set for each
    module whose tensors are all float32 (the precision fairseq builds models in): loading
    makes those tensors the module's own, where a copy would read every page of the file."""
    float32: dict[str, bool] = {}
    for key, value in weights.items():
        module = key.rpartition(".")[0]
        own = isinstance(value, torch.Tensor) and value.dtype == torch.float32
        float32[module] = float32.get(module, True) and own
    marked = OrderedDict(weights)
    metadata = OrderedDict(getattr(weights, "_metadata", {}) or {})
    for module, assign in float32.items():
        if assign:
            metadata[module] = {**metadata.get(module, {}), "assign_to_params_buffers": True}
    marked._metadata = metadata  # type: ignore[attr-defined]
    return marked


def tie_shared_parameters(model: nn.Module) -> None:
    """Make parameters that are the same bytes (a tied embedding, each module given its own
    parameter by an in-place load) one parameter again, as the model was built: a cast or a
    move then converts the weight once."""
    first: dict[tuple[Any, ...], nn.Parameter] = {}
    for module in model.modules():
        for name, parameter in list(module._parameters.items()):
            if parameter is None or parameter.numel() == 0:  # empty ones share address 0
                continue
            view = (parameter.data_ptr(), parameter.dtype, parameter.shape, parameter.stride())
            kept = first.setdefault(view, parameter)
            if kept is not parameter:
                module._parameters[name] = kept


class _UnwrittenRandomWeights(TorchFunctionMode):
    """Random initialisers (``nn.init``'s uniform and normal draws, which every initialiser of
    fairseq's models ends in) leave the tensor as allocated. A model built to have every tensor
    replaced by its checkpoint's (a strict load) then writes no page of weights it will never
    read: 2.5 GB and most of the load's time for an NLLB-600M-shaped model."""

    SKIPPED = frozenset(
        [torch.Tensor.uniform_, torch.Tensor.normal_]
        + [getattr(nn.init, f"{name}_") for name in ("uniform", "normal", "trunc_normal",
           "xavier_uniform", "xavier_normal", "kaiming_uniform", "kaiming_normal", "orthogonal")]
    )  # fmt: skip

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func in self.SKIPPED:
            return args[0] if args else kwargs["tensor"]  # nn.init passes it by name
        return func(*args, **kwargs)


def _decoding_loader(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def load_to_decode(*args: Any, **kwargs: Any) -> Any:
        strict = inspect.signature(load).bind(*args, **kwargs).arguments.get("strict", True)
        token = _DECODING_LOAD.set(True)
        try:
            with _UnwrittenRandomWeights() if strict and mapping_enabled() else nullcontext():
                ensemble, cfg, task = load(*args, **kwargs)
        finally:
            _DECODING_LOAD.reset(token)
        for model in ensemble:
            tie_shared_parameters(model)
        return ensemble, cfg, task

    load_to_decode.__beamplugin_mapped__ = True  # type: ignore[attr-defined]
    return load_to_decode


def _mapping_loader(load: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(load)
    def load_checkpoint(path: str, arg_overrides: dict[str, Any] | None = None, *args: Any,
                        **kwargs: Any) -> Any:  # fmt: skip
        if maps(path):
            return load_mapped(path, arg_overrides)
        return load(path, arg_overrides, *args, **kwargs)

    load_checkpoint.__beamplugin_mapped__ = True  # type: ignore[attr-defined]
    return load_checkpoint


def install() -> None:
    """Map checkpoints in fairseq's loads to decode: ``load_model_ensemble_and_task`` (which
    ``load_model_ensemble`` calls) marks its loads, ``load_checkpoint_to_cpu`` maps them."""
    for name, wrap in (("load_model_ensemble_and_task", _decoding_loader),
                       ("load_checkpoint_to_cpu", _mapping_loader)):  # fmt: skip
        function = getattr(checkpoint_utils, name)
        if not getattr(function, "__beamplugin_mapped__", False):
            setattr(checkpoint_utils, name, wrap(function))
