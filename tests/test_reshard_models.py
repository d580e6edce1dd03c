"""Whole models with AdamW moved between frameworks and process counts, compared bit-exactly."""

import pytest

import scenarios

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize(
    "save_kind,save_world,load_kind,load_world",
    [
        pytest.param("fsdp2", 2, "fsdp2", 3, id="fsdp2x2->fsdp2x3"),
        pytest.param("fsdp2", 2, "plain", 1, id="fsdp2x2->single"),
        pytest.param("fsdp2", 3, "ddp", 2, id="fsdp2x3->ddp2"),
        pytest.param("ddp", 2, "fsdp2", 4, id="ddp2->fsdp2x4"),
        pytest.param("plain", 1, "fsdp2", 2, id="single->fsdp2x2"),
        pytest.param("fsdp1", 2, "fsdp2", 3, id="fsdp1x2->fsdp2x3"),
        pytest.param("fsdp1", 2, "plain", 1, id="fsdp1x2->single"),
        pytest.param("fsdp2", 4, "fsdp1", 3, id="fsdp2x4->fsdp1x3"),
    ],
)
def test_model_reshard(dist_pool, tmp_path, save_kind, save_world, load_kind, load_world):
    dist_pool.run(scenarios.module_reshard, str(tmp_path / "ckpt"), save_kind, save_world, load_kind, load_world)
