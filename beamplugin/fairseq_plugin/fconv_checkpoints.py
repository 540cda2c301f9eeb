"""Run an existing fairseq ``fconv`` checkpoint as our ``convs2s`` model.

The weights need no change (the state dicts are the same); only the architecture name the
checkpoint records does, because fairseq builds the model from it, and its task becomes
``beam_translation``, so that fairseq's tools and ``from_pretrained(...).translate()`` decode
it with our generator.

    python -m beamplugin.fairseq_plugin.fconv_checkpoints fconv.pt convs2s.pt
"""

import argparse
import sys
from typing import Any

import torch

from beamplugin.fairseq_plugin.checkpoint_safety import allow_fairseq_checkpoints, check_checkpoint

FCONV_TO_CONVS2S = {
    "fconv": "convs2s",
    "fconv_iwslt_de_en": "convs2s_iwslt_de_en",
    "fconv_wmt_en_ro": "convs2s_wmt_en_ro",
    "fconv_wmt_en_de": "convs2s_wmt_en_de",
    "fconv_wmt_en_fr": "convs2s_wmt_en_fr",
}


def _rename(model_cfg: Any) -> None:
    get, put = (
        (model_cfg.get, model_cfg.__setitem__)
        if isinstance(model_cfg, dict)
        else (lambda k: getattr(model_cfg, k, None), lambda k, v: setattr(model_cfg, k, v))
    )
    arch = get("arch") or get("_name")
    if arch not in FCONV_TO_CONVS2S:
        raise ValueError(
            f"architecture {arch!r} is not an fconv translation model; "
            f"known: {', '.join(FCONV_TO_CONVS2S)}"
        )
    put("arch", FCONV_TO_CONVS2S[arch])
    put("_name", FCONV_TO_CONVS2S[arch])


def _our_task(task_cfg: Any) -> None:
    if isinstance(task_cfg, dict):
        task_cfg["_name"] = "beam_translation"
    else:
        task_cfg.task = "beam_translation"


def fconv_as_convs2s(state: dict[str, Any]) -> dict[str, Any]:
    """Point a loaded fairseq checkpoint's architecture at the matching convs2s one and its
    task at beam_translation, in place."""
    found = False
    if state.get("args") is not None:
        _rename(state["args"])
        _our_task(state["args"])
        found = True
    cfg = state.get("cfg") or {}
    if cfg.get("model") is not None:
        _rename(cfg["model"])
        if cfg.get("task") is not None:
            _our_task(cfg["task"])
        found = True
    if not found:
        raise ValueError("the checkpoint records no model architecture (no 'args' or 'cfg.model')")
    return state


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="fconv checkpoint (.pt)")
    parser.add_argument("target", help="where to write the convs2s checkpoint")
    args = parser.parse_args(argv)
    allow_fairseq_checkpoints()
    check_checkpoint(args.source)
    # The raw dict, not fairseq's upgraded one, so the file keeps its plain, loadable objects.
    state = torch.load(args.source, map_location="cpu")
    torch.save(fconv_as_convs2s(state), args.target)
    print(f"wrote {args.target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
