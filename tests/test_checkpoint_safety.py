import argparse

import numpy as np
import pytest
import torch
from fairseq import checkpoint_utils
from hostile import RunsCode

import beamplugin  # noqa: F401  (installs the safe loader into fairseq)
from beamplugin.fairseq_plugin.checkpoint_safety import UnsafeCheckpointError, check_checkpoint


def _fairseq_like_state() -> dict:
    return {
        "args": argparse.Namespace(arch="convs2s_tiny", lr=[0.25]),
        "cfg": {"model": argparse.Namespace(arch="convs2s_tiny"), "task": {"_name": "x"}},
        "model": {"encoder.embed_tokens.weight": torch.randn(4, 3)},
        "extra_state": {"best": np.float64(3.5), "val_loss": np.float32(2.0)},
        "optimizer_history": [{"num_updates": 3}],
    }


def test_fairseq_checkpoint_objects_load_with_weights_only(tmp_path):
    # A whole fairseq checkpoint going through fairseq-generate is tested in test_fairseq_cli.
    path = tmp_path / "ok.pt"
    state = _fairseq_like_state()
    torch.save(state, path)
    check_checkpoint(path)
    loaded = torch.load(path)  # torch's default: the weights_only unpickler
    key = "encoder.embed_tokens.weight"
    assert torch.equal(loaded["model"][key], state["model"][key])
    assert loaded["extra_state"]["best"] == 3.5
    assert loaded["args"] == state["args"] and loaded["cfg"]["model"].arch == "convs2s_tiny"


def test_hostile_checkpoint_is_refused_by_name_and_runs_nothing(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "hostile.pt"
    torch.save({"model": {}, "payload": RunsCode(str(marker))}, path)
    with pytest.raises(UnsafeCheckpointError, match=r"posix\.system|os\.system"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
    assert not marker.exists()


def test_truncated_checkpoint_is_a_clear_error(tmp_path):
    path = tmp_path / "cut.pt"
    torch.save(_fairseq_like_state(), path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UnsafeCheckpointError, match="corrupt or truncated"):
        checkpoint_utils.load_checkpoint_to_cpu(str(path))
