"""``timm:`` encoders with random-weight timm models (tiny configs, no download).

timm needs torchvision, and torchvision's PyPI wheels are CUDA builds that fail to import beside
the CPU-only torch of CI (``operator torchvision::nms does not exist``), so the tests that build a
timm model skip there with that reason; they run wherever timm imports (a GPU box's image has it:
``python -m pytest -q tests/test_timm_encoder.py``). The spec parsing tests need no timm.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from featurestore.extract.encoders import EncoderError, load_encoder, resolve_layout
from featurestore.extract.timm_models import parse_timm_spec

# A DINOv2-with-registers ViT cut down to CPU-test size: CLS + 4 registers, patch 14, 2x2 grid.
TINY = "vit_small_patch14_reg4_dinov2,img_size=28,depth=1,embed_dim=32,num_heads=2"


def _timm() -> Any:
    try:
        import timm
    except Exception as error:  # ImportError, or torchvision's RuntimeError beside a CPU torch
        pytest.skip(f"timm does not import here: {type(error).__name__}: {str(error)[:120]}")
    return timm


@pytest.fixture(autouse=True)
def _offline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Never reach a hub from the tests, even where one is reachable.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def test_spec_options_are_parsed_and_checked() -> None:
    name, opts = parse_timm_spec("s", "hf-hub:org/model,pretrained=false,img_size=224,init_values=1e-5,"
                                 "dynamic_img_size=true,checkpoint=./a.bin")
    assert name == "hf-hub:org/model"
    assert opts == {"pretrained": False, "img_size": 224, "init_values": 1e-5, "dynamic_img_size": True,
                    "checkpoint": "./a.bin"}
    with pytest.raises(EncoderError, match="options are KEY=VALUE"):
        parse_timm_spec("s", "vit,img_size")
    with pytest.raises(EncoderError, match="given twice"):
        parse_timm_spec("s", "vit,depth=1,depth=2")
    with pytest.raises(EncoderError, match="use true or false"):
        parse_timm_spec("s", "vit,pretrained=maybe")
    with pytest.raises(EncoderError, match="timm:MODEL_NAME"):
        parse_timm_spec("s", ",depth=1")


def test_comma_inside_a_value_is_refused() -> None:
    with pytest.raises(EncoderError, match="options are KEY=VALUE"):
        parse_timm_spec("s", "vit,checkpoint=./a,b.bin")


def test_random_weights_layout_from_the_model() -> None:
    timm = _timm()
    torch.manual_seed(7)
    expected_draw = torch.rand(1)
    torch.manual_seed(7)
    enc = load_encoder(f"timm:{TINY},pretrained=false")
    assert torch.equal(torch.rand(1), expected_draw)  # building the model did not move the user's RNG
    model = timm.create_model("vit_small_patch14_reg4_dinov2", img_size=28, depth=1, embed_dim=32,
                              num_heads=2, num_classes=0)
    assert enc.prefix_tokens == model.num_prefix_tokens == 5
    assert enc.patch_size == (14, 14) and enc.default_name == "vit_small_patch14_reg4_dinov2"
    assert enc.mean == tuple(model.pretrained_cfg["mean"])
    x = torch.randn(3, 3, 28, 28)
    with torch.inference_mode():
        out = enc(x)
    assert out.shape == (3, 5 + 4, 32)
    layout = resolve_layout(enc, out.shape[1], (28, 28), "patch")
    assert layout.to_dict() == {"tokens": "patch", "prefix_tokens": 0, "grid": [2, 2], "encoder_tokens": 9,
                                "encoder_prefix_tokens": 5}
    # The tokens are the model's forward_features, prefix tokens first.
    model.load_state_dict(enc.module.model.state_dict())
    with torch.inference_mode():
        assert torch.equal(model.eval().forward_features(x), out)


def test_fixed_image_size_error_names_the_fix() -> None:
    _timm()
    enc = load_encoder(f"timm:{TINY},pretrained=false")
    with pytest.raises(EncoderError, match="img_size=42 .or dynamic_img_size=true"):
        enc(torch.randn(1, 3, 42, 42))
    dyn = load_encoder(f"timm:{TINY},pretrained=false,dynamic_img_size=true")
    with torch.inference_mode():
        assert dyn(torch.randn(1, 3, 42, 42)).shape == (1, 5 + 9, 32)


def test_checkpoint_file_sets_the_weights_and_the_hash(tmp_path: Path) -> None:
    timm = _timm()
    torch.manual_seed(1)
    source = timm.create_model("vit_small_patch14_reg4_dinov2", img_size=28, depth=1, embed_dim=32,
                               num_heads=2, num_classes=0)
    torch.save(source.state_dict(), tmp_path / "w.pth")
    loaded = load_encoder(f"timm:{TINY},checkpoint={tmp_path / 'w.pth'}")
    random_a = load_encoder(f"timm:{TINY},pretrained=false")
    for name, tensor in source.state_dict().items():
        assert torch.equal(loaded.module.model.state_dict()[name], tensor), name
    assert loaded.weights_hash != random_a.weights_hash
    # Other weights in the file -> another hash.
    with torch.no_grad():
        source.norm.weight.add_(1.0)
    torch.save(source.state_dict(), tmp_path / "w2.pth")
    assert load_encoder(f"timm:{TINY},checkpoint={tmp_path / 'w2.pth'}").weights_hash != loaded.weights_hash
    with pytest.raises(EncoderError, match="does not exist"):
        load_encoder(f"timm:{TINY},checkpoint={tmp_path / 'missing.pth'}")
    torch.save({"unrelated": torch.zeros(3)}, tmp_path / "bad.pth")
    with pytest.raises(EncoderError, match="a state dict for"):
        load_encoder(f"timm:{TINY},checkpoint={tmp_path / 'bad.pth'}")


def test_pretrained_without_a_hub_says_what_to_do() -> None:
    _timm()
    with pytest.raises(EncoderError, match="checkpoint=FILE .local weights. or pretrained=false"):
        load_encoder("timm:vit_small_patch14_reg4_dinov2.lvd142m,img_size=28,depth=1,embed_dim=32,num_heads=2")
    with pytest.raises(EncoderError, match="cannot build timm encoder"):
        load_encoder("timm:no_such_model_xyz,pretrained=false")


def test_cnn_maps_become_grid_tokens() -> None:
    _timm()
    enc = load_encoder("timm:resnet18,pretrained=false")
    with torch.inference_mode():
        out = enc(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 4, 512) and enc.prefix_tokens == 0 and enc.patch_size == (32, 32)
    assert resolve_layout(enc, 4, (64, 64), "patch").grid == (2, 2)


def test_timm_extraction_records_layout_and_keys_on_weights(tmp_path: Path) -> None:
    timm = _timm()
    import featurestore
    from featurestore.extract.dist import Coordinator
    from featurestore.extract.run import ExtractOptions, extract

    images = np.random.default_rng(0).integers(0, 256, (5, 28, 28, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", images)
    ckpts = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        model = timm.create_model("vit_small_patch14_reg4_dinov2", img_size=28, depth=1, embed_dim=32,
                                  num_heads=2, num_classes=0)
        torch.save(model.state_dict(), tmp_path / f"w{seed}.pth")
        ckpts.append(tmp_path / f"w{seed}.pth")
    metas = []
    for i, ckpt in enumerate(ckpts):
        result = extract(ExtractOptions(images=f"npy:{tmp_path / 'x.npy'}", encoder=f"timm:{TINY},checkpoint={ckpt}",
                                        store=str(tmp_path / "s"), dataset="toy", split=f"s{i}", dtype="float32",
                                        batch_size=8, num_workers=0, progress=False), Coordinator())
        assert result.status == "complete"
        arr = featurestore.open_store(str(tmp_path / "s")).open("toy", "vit_small_patch14_reg4_dinov2", f"s{i}")
        assert arr.shape == (5, 4, 32)
        metas.append(arr.metadata)
    layout = metas[0]["token_layout"]
    assert layout["grid"] == [2, 2] and layout["encoder_prefix_tokens"] == 5 and layout["encoder_tokens"] == 9
    assert metas[0]["encoder"]["spec"].startswith("timm:vit_small_patch14_reg4_dinov2")
    assert metas[0]["encoder"]["weights_hash"] != metas[1]["encoder"]["weights_hash"]
    assert metas[0]["cache_key"] != metas[1]["cache_key"]
    assert os.path.basename(str(ckpts[0])) in metas[0]["encoder"]["spec"]
