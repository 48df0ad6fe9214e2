"""Tests of the proxy model (geomesh.models): shapes, tying, sizes, determinism, causality, learning."""

import math

import pytest
import torch

from geomesh.models import GPT, MODEL_PRESETS, ModelConfig, build_model, model_config

TINY = ModelConfig(vocab_size=64, n_layers=2, d_model=32, n_heads=4, seq_len=16)


def test_forward_shapes_and_loss():
    model = build_model(TINY, seed=0)
    idx = torch.randint(0, TINY.vocab_size, (3, 16))
    logits, loss = model(idx)
    assert logits.shape == (3, 16, TINY.vocab_size)
    assert loss is None
    targets = torch.randint(0, TINY.vocab_size, (3, 10))
    logits, loss = model(idx[:, :10], targets)
    assert logits.shape == (3, 10, TINY.vocab_size)
    assert loss.ndim == 0
    # At init the logits are small, so the loss of random targets is close to ln(vocab).
    assert loss.item() == pytest.approx(math.log(TINY.vocab_size), abs=0.2)


def test_sequence_longer_than_seq_len_is_rejected():
    model = build_model(TINY, seed=0)
    with pytest.raises(ValueError, match="seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_embeddings_are_tied_and_counted_once():
    model = build_model(TINY, seed=0)
    assert model.lm_head.weight is model.tok_emb.weight
    d, h, L, V = TINY.d_model, TINY.hidden_dim, TINY.n_layers, TINY.vocab_size
    expected = V * d + L * (4 * d * d + 3 * d * h + 2 * d) + d
    assert model.num_params() == expected


def test_state_dict_holds_only_parameters():
    model = build_model(TINY, seed=0)
    keys = set(model.state_dict())
    assert not any("rope" in k for k in keys)
    assert keys == {name for name, _ in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize(
    "preset, low, high",
    [("nano", 0.5e6, 0.7e6), ("micro", 1.0e6, 1.5e6), ("mini", 3e6, 5e6), ("small", 9e6, 12e6), ("base", 18e6, 22e6)],
)
def test_preset_parameter_counts(preset, low, high):
    cfg = model_config(preset)
    assert cfg.vocab_size == 4096 and cfg.seq_len == 128
    with torch.device("meta"):  # count without allocating or initialising
        n = GPT(cfg).num_params()
    assert low <= n <= high


def test_presets_grow_in_size():
    counts = []
    for name in MODEL_PRESETS:
        with torch.device("meta"):
            counts.append(GPT(model_config(name)).num_params())
    assert counts == sorted(counts)


def test_model_config_overrides_and_unknown_names():
    cfg = model_config("micro", seq_len=64, vocab_size=512)
    assert (cfg.seq_len, cfg.vocab_size, cfg.d_model) == (64, 512, 128)
    with pytest.raises(ValueError, match="nano.*micro"):
        model_config("huge")
    with pytest.raises(ValueError, match="n_layer"):
        model_config("nano", n_layer=3)


def test_default_mlp_hidden_is_swiglu_size():
    assert ModelConfig(d_model=128, n_heads=4).hidden_dim == 352  # 8/3 * 128 = 341.3 -> 352
    assert ModelConfig(d_model=96, n_heads=4).hidden_dim == 256
    assert ModelConfig(d_model=96, n_heads=4, mlp_hidden=100).hidden_dim == 100


def test_same_seed_gives_identical_parameters_and_keeps_caller_rng():
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    a = build_model(TINY, seed=7)
    assert torch.equal(torch.rand(3), expected_draw)  # build_model did not consume the caller's RNG
    b = build_model(TINY, seed=7)
    c = build_model(TINY, seed=8)
    for (name, pa), pb, pc in zip(a.state_dict().items(), b.state_dict().values(), c.state_dict().values()):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.tok_emb.weight, c.tok_emb.weight)


def test_scaled_init_of_residual_projections():
    cfg = ModelConfig(vocab_size=64, n_layers=8, d_model=128, n_heads=4, seq_len=16)
    model = build_model(cfg, seed=0)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)
    residual = model.blocks[0].attn.proj.weight.std().item()
    assert residual == pytest.approx(0.02 / 4, rel=0.1)  # 1/sqrt(2 * 8) = 1/4


def test_attention_is_causal():
    model = build_model(TINY, seed=0).eval()
    idx = torch.randint(0, TINY.vocab_size, (2, 16))
    changed = idx.clone()
    changed[:, 10] = (changed[:, 10] + 1) % TINY.vocab_size
    with torch.no_grad():
        before, _ = model(idx)
        after, _ = model(changed)
    assert torch.allclose(before[:, :10], after[:, :10], atol=1e-6)
    assert not torch.allclose(before[:, 10:], after[:, 10:])


@pytest.fixture
def one_thread():
    """Run a tiny model on one intra-op thread: faster, and robust to other processes sharing the CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_loss_falls_when_training_on_a_tiny_corpus(one_thread):
    text = "the quick brown fox jumps over the lazy dog. " * 40
    vocab = sorted(set(text))
    data = torch.tensor([vocab.index(ch) for ch in text])
    cfg = ModelConfig(vocab_size=len(vocab), n_layers=2, d_model=64, n_heads=4, seq_len=32)
    model = build_model(cfg, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(60):
        starts = torch.randint(0, len(data) - cfg.seq_len - 1, (8,), generator=gen)
        x = torch.stack([data[s : s + cfg.seq_len] for s in starts])
        y = torch.stack([data[s + 1 : s + 1 + cfg.seq_len] for s in starts])
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(d_model=100, n_heads=3), "d_model"),
        (dict(d_model=12, n_heads=4), "n_heads"),  # head dim 3 is odd: RoPE needs pairs
        (dict(n_layers=0), "n_layers"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(seq_len=0), "seq_len"),
        (dict(mlp_hidden=0), "mlp_hidden"),
    ],
)
def test_config_validation_names_the_field(kwargs, field):
    cfg = ModelConfig(**{**dict(d_model=32, n_heads=4), **kwargs})
    with pytest.raises(ValueError, match=field):
        cfg.validate()
    with pytest.raises(ValueError, match=field):
        GPT(cfg)
