"""`moestream info` on a directory holding only Kimi K3's real config.json: the real figures, from the config."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from moestream import Engine
from moestream.errors import CheckpointError
from moestream.info import model_info

DATA = Path(__file__).parent / "data" / "kimi_k3_config.json"


@pytest.fixture(scope="module")
def k3_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("k3_config_only")
    shutil.copy(DATA, d / "config.json")
    return d


def test_real_k3_figures_from_config_alone(k3_dir):
    info = model_info(k3_dir)
    assert info.config_only
    assert info.model_type == "kimi_k3" and info.num_layers == 93 and len(info.moe_layers) == 92
    assert info.total_params == 2_779_484_478_208  # about 2.78 T
    assert info.active_params == 104_189_614_848  # about 104 B
    assert info.total_bytes == 1_559_965_606_912  # about 1.56 TB
    assert info.bytes_per_expert == 17_547_264  # six tensors of one MXFP4 expert, spec section 3
    assert info.expert_bytes_per_token_cold == 16 * 92 * 17_547_264  # 25.8 GB
    assert info.dense_bytes == 113_509_540_864  # about 114 GB of bf16/fp32 spine


def test_config_only_dir_cannot_run(k3_dir):
    with pytest.raises(CheckpointError, match="no safetensors weights"):
        Engine.open(k3_dir)
