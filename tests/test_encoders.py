"""Encoders: builtin tiny-vit, python factories, local torch.hub, transformers Dinov2; tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from featurestore.extract.encoders import (
    Encoder,
    EncoderError,
    TinyViT,
    load_encoder,
    resolve_layout,
    weights_hash,
)


def test_tiny_vit_is_seeded_and_has_cls_registers_and_grid() -> None:
    a, b = load_encoder("builtin:tiny-vit"), load_encoder("builtin:tiny-vit")
    assert a.weights_hash == b.weights_hash and len(a.weights_hash) == 64
    assert a.prefix_tokens == 3 and a.patch_size == (16, 16) and a.default_name == "tiny-vit"
    x = torch.randn(2, 3, 48, 64)
    with torch.inference_mode():
        out = a(x)
        assert torch.equal(out, b(x))
    assert out.shape == (2, 3 + 3 * 4, 128) and out.dtype == torch.float32
    # Samples do not see each other: one image alone gives the same tokens (up to float rounding).
    with torch.inference_mode():
        assert torch.allclose(a(x[:1]), out[:1], atol=1e-5)
    # Another seed is another encoder.
    assert weights_hash(TinyViT(seed=1), "") != a.weights_hash


def test_vit_s14_builtin_has_the_dinov2_reg_small_shape() -> None:
    encoder = load_encoder("builtin:vit-s14")
    assert sum(p.numel() for p in encoder.module.parameters()) == 21_522_432  # ViT-S/14 + 4 registers
    assert encoder.prefix_tokens == 5 and encoder.patch_size == (14, 14) and encoder.default_name == "vit-s14"
    with torch.inference_mode():
        out = encoder(torch.randn(1, 3, 224, 224))
    assert out.shape == (1, 5 + 16 * 16, 384)
    assert encoder.weights_hash == load_encoder("builtin:vit-s14").weights_hash != load_encoder("builtin:tiny-vit").weights_hash


def test_tiny_vit_does_not_move_the_global_rng() -> None:
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    load_encoder("builtin:tiny-vit")
    assert torch.equal(torch.rand(3), expected)


def test_weights_hash_sees_every_tensor() -> None:
    module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
    before = weights_hash(module, "")
    with torch.no_grad():
        module[1].running_mean[2] += 1e-3  # a buffer, not a parameter
    assert weights_hash(module, "") != before
    assert weights_hash(lambda x: x, "python:a:b") != weights_hash(lambda x: x, "python:a:c")


class _Tokens(torch.nn.Module):
    num_prefix_tokens = 1
    patch_size = 8

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Conv2d(3, 6, 8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        grid = self.proj(x).flatten(2).transpose(1, 2)
        return torch.cat([grid.mean(1, keepdim=True), grid], 1)


def tokens_module() -> torch.nn.Module:
    return _Tokens()


def pooled_callable() -> object:
    return lambda x: x.mean((2, 3))  # [B, C]: wrong rank


def test_python_encoder_module_and_wrong_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    enc = load_encoder("python:test_encoders:tokens_module")
    assert enc.prefix_tokens == 1 and enc.patch_size == (8, 8) and enc.default_name == "tokens_module"
    out = enc(torch.zeros(2, 3, 16, 24))
    assert out.shape == (2, 7, 6)
    bad = load_encoder("python:test_encoders:pooled_callable")
    with pytest.raises(EncoderError, match=r"returned shape \[2, 3\].*\[B, T, D\]"):
        bad(torch.zeros(2, 3, 16, 16))
    with pytest.raises(EncoderError, match="cannot import module"):
        load_encoder("python:not_a_module_q:f")
    with pytest.raises(EncoderError, match="unknown builtin encoder 'huge-vit': available: tiny-vit, vit-l14, vit-s14"):
        load_encoder("builtin:huge-vit")


def _plain(prefix: int | None = None, patch: tuple[int, int] | None = None) -> Encoder:
    return Encoder(lambda x: x, "python:x:y", "y", "0" * 64, prefix, patch)


def test_resolve_layout_modes_and_inference() -> None:
    tokens = torch.arange(2 * 21 * 4, dtype=torch.float32).reshape(2, 21, 4)
    patch = resolve_layout(_plain(5, (16, 16)), 21, (64, 64), "patch")
    assert patch.grid == (4, 4) and torch.equal(patch.select(tokens), tokens[:, 5:])
    assert patch.to_dict()["prefix_tokens"] == 0 and patch.to_dict()["grid"] == [4, 4]
    cls = resolve_layout(_plain(5, (16, 16)), 21, (64, 64), "cls")
    assert torch.equal(cls.select(tokens), tokens[:, 0]) and cls.to_dict()["grid"] is None
    every = resolve_layout(_plain(5, (16, 16)), 21, (64, 64), "all")
    assert every.to_dict()["prefix_tokens"] == 5 and torch.equal(every.select(tokens), tokens)
    # No hints: the patch size that leaves a small prefix (16 px -> 16 patches + 5).
    guessed = resolve_layout(_plain(), 21, (64, 64), "patch")
    assert guessed.encoder_prefix_tokens == 5 and guessed.grid == (4, 4)
    # Only the patch size known: prefix = tokens - grid.
    assert resolve_layout(_plain(None, (16, 16)), 17, (64, 64), "patch").encoder_prefix_tokens == 1
    assert resolve_layout(_plain(), 21, (64, 64), "patch", prefix_override=1).grid is None
    with pytest.raises(EncoderError, match="--prefix-tokens"):
        resolve_layout(_plain(), 1000, (64, 64), "patch")
    # An override beyond the tokens names itself, not "pass --prefix-tokens N".
    with pytest.raises(EncoderError, match=r"--prefix-tokens 30 does not fit .*21 tokens: give 0\.\.21"):
        resolve_layout(_plain(5, (16, 16)), 21, (64, 64), "patch", prefix_override=30)
    with pytest.raises(EncoderError, match="no CLS token"):
        resolve_layout(_plain(0, (16, 16)), 16, (64, 64), "cls")


HUBCONF = '''
import torch

dependencies = ["torch"]


class _Net(torch.nn.Module):
    patch_size = 4
    num_register_tokens = 2

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Conv2d(3, 8, 4, 4)

    def forward(self, x):  # like DINOv2's hub models: forward() gives the CLS token only
        return self.forward_features(x)["x_norm_clstoken"]

    def forward_features(self, x):
        grid = self.proj(x).flatten(2).transpose(1, 2)
        return {"x_norm_clstoken": grid.mean(1), "x_norm_regtokens": grid[:, :2] * 0,
                "x_norm_patchtokens": grid}


def tiny_net(pretrained=True):
    return _Net()
'''


def test_torchhub_local_directory(tmp_path: Path) -> None:
    (tmp_path / "hubconf.py").write_text(HUBCONF)
    enc = load_encoder(f"torchhub:{tmp_path}:tiny_net")
    assert enc.default_name == "tiny_net" and enc.prefix_tokens == 3 and enc.patch_size == (4, 4)
    out = enc(torch.randn(2, 3, 8, 8))
    assert out.shape == (2, 3 + 4, 8)
    layout = resolve_layout(enc, out.shape[1], (8, 8), "patch")
    assert layout.grid == (2, 2) and layout.select(out).shape == (2, 4, 8)
    with pytest.raises(EncoderError, match="cannot load torchhub encoder"):
        load_encoder(f"torchhub:{tmp_path}:no_such_entry")


@pytest.fixture(scope="module")
def tiny_dinov2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                       intermediate_size=64, patch_size=8, image_size=32)
    torch.manual_seed(0)
    model = transformers.Dinov2Model(config).eval()
    path = tmp_path_factory.mktemp("dinov2-tiny")
    model.save_pretrained(path)
    return path


def test_hf_dinov2_from_a_local_directory(tiny_dinov2: Path) -> None:
    import transformers

    enc = load_encoder(f"hf:{tiny_dinov2}")
    assert enc.patch_size == (8, 8) and enc.default_name == tiny_dinov2.name
    x = torch.randn(2, 3, 32, 32)
    with torch.inference_mode():
        out = enc(x)
        reference = transformers.AutoModel.from_pretrained(tiny_dinov2).eval()(pixel_values=x).last_hidden_state
    assert out.shape == (2, 1 + 16, 32) and torch.equal(out, reference)
    layout = resolve_layout(enc, out.shape[1], (32, 32), "patch")
    assert layout.encoder_prefix_tokens == 1 and layout.grid == (4, 4)
    assert enc.weights_hash == load_encoder(f"hf:{tiny_dinov2}").weights_hash
    with pytest.raises(EncoderError, match="cannot load hf encoder"):
        load_encoder(f"hf:{tiny_dinov2 / 'missing'}")


def test_hf_dinov2_extraction_into_a_store(tiny_dinov2: Path, tmp_path: Path) -> None:
    import numpy as np
    import transformers

    import featurestore
    from featurestore.extract.dist import Coordinator
    from featurestore.extract.run import ExtractOptions, extract
    from featurestore.extract.sources import Preprocessing

    images = np.random.default_rng(0).integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)
    np.save(tmp_path / "x.npy", images)
    result = extract(ExtractOptions(images=f"npy:{tmp_path / 'x.npy'}", encoder=f"hf:{tiny_dinov2}",
                                    store=str(tmp_path / "s"), dataset="toy", split="all", dtype="float32",
                                    batch_size=8, num_workers=0, progress=False), Coordinator())
    assert result.status == "complete"
    arr = featurestore.open_store(str(tmp_path / "s")).open("toy", tiny_dinov2.name, "all")
    assert arr.shape == (5, 16, 32) and arr.metadata["token_layout"]["grid"] == [4, 4]
    assert arr.metadata["encoder"]["spec"] == f"hf:{tiny_dinov2}"
    model = transformers.AutoModel.from_pretrained(tiny_dinov2).eval()
    prep = Preprocessing()
    x = torch.stack([prep.apply(img)[0] for img in images])
    with torch.inference_mode():
        expected = model(pixel_values=x).last_hidden_state[:, 1:]
    assert torch.allclose(arr.read(list(range(5))), expected, atol=1e-5)
