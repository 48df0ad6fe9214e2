"""Ecosystem integrations: transformers models, token files and HF datasets, telemetry sinks (TensorBoard,
W&B), the lm-evaluation-harness adapter, and the one clear message when an optional extra is missing."""

from __future__ import annotations

import json
import math
import os
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import yaml

# No hub: HF libraries fail fast instead of trying the network (set before they are first imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from conftest import tiny_scenario_dict  # noqa: E402
from geomesh.config import ConfigError, DataConfig, ModelConfig, load_scenario  # noqa: E402
from geomesh.data import BatchStream, Corpus, CorpusSpec, DataError, load_corpus  # noqa: E402
from geomesh.integrations import MissingDependencyError, require  # noqa: E402
from geomesh.methods import get_method  # noqa: E402
from geomesh.runtime.emulated import EmulatedRun, RunOptions  # noqa: E402
from geomesh.telemetry import Telemetry, read_events  # noqa: E402

HAVE_TRANSFORMERS = __import__("importlib").util.find_spec("transformers") is not None
HAVE_DATASETS = __import__("importlib").util.find_spec("datasets") is not None
HAVE_TENSORBOARD = __import__("importlib").util.find_spec("tensorboard") is not None
HAVE_LM_EVAL = __import__("importlib").util.find_spec("lm_eval") is not None
needs_hf = pytest.mark.skipif(not HAVE_TRANSFORMERS, reason="transformers not installed: pip install 'geomesh[hf]'")
needs_datasets = pytest.mark.skipif(not HAVE_DATASETS, reason="datasets not installed: pip install 'geomesh[hf]'")
needs_tb = pytest.mark.skipif(not HAVE_TENSORBOARD, reason="tensorboard not installed: pip install 'geomesh[tensorboard]'")
needs_lm_eval = pytest.mark.skipif(not HAVE_LM_EVAL, reason="lm-eval not installed: pip install 'geomesh[eval]'")

LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}
GPT2 = {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}


def scenario_from(tmp_path: Path, paths: list[str], **sections):
    d = tiny_scenario_dict(paths)
    d["training"]["zero_shot_items"] = 20
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(d.get(key), dict):
            d[key] = {**d[key], **value}
        else:
            d[key] = value
    path = tmp_path / "scenario.yaml"
    path.write_text(yaml.safe_dump(d))
    return load_scenario(path)


def run(scenario, method="geomesh", out=None, **opts):
    em = EmulatedRun(scenario, get_method(method), RunOptions(out_dir=out, progress=False, **opts))
    return em, em.run()


# ---- missing extras ------------------------------------------------------------------------------------


def test_a_missing_extra_names_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(MissingDependencyError) as info:
        require("wandb", "Weights & Biases logging (logging.wandb)")
    msg = str(info.value)
    assert "pip install 'geomesh[wandb]'" in msg and "logging.wandb" in msg and "\n" not in msg
    assert isinstance(info.value, ConfigError)  # the CLI prints it as one error line

    from geomesh.errors import USER_ERRORS

    assert isinstance(info.value, USER_ERRORS)


def test_missing_extras_for_each_feature(monkeypatch, tmp_path):
    from geomesh.config import LoggingConfig, WandbConfig
    from geomesh.telemetry_sinks import make_sinks

    for module in ("wandb", "torch.utils.tensorboard", "transformers", "datasets"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(MissingDependencyError, match=r"geomesh\[wandb\]"):
        make_sinks(LoggingConfig(wandb=WandbConfig(project="p")), tmp_path)
    with pytest.raises(MissingDependencyError, match=r"geomesh\[tensorboard\]"):
        make_sinks(LoggingConfig(tensorboard=str(tmp_path / "tb")), tmp_path)
    from geomesh.models import build_proxy_model

    with pytest.raises(MissingDependencyError, match=r"geomesh\[hf\]"):
        build_proxy_model(ModelConfig(seq_len=16, hf_config=dict(LLAMA)), 300, 0)
    with pytest.raises(MissingDependencyError, match=r"geomesh\[hf\]"):
        load_corpus(DataConfig(format="hf", hf_dataset="json", paths=[__file__]), cache_dir=tmp_path)


def test_missing_extra_in_the_cli_is_one_error_line(monkeypatch, tmp_path, capsys, small_corpus):
    from geomesh import integrations
    from geomesh.cli import eval as eval_command
    from geomesh.integrations import lm_eval_adapter

    # `geomesh eval` imports the adapter when it runs: here, for the first time without lm-eval (the module
    # loaded with it comes back after the test, in sys.modules and on its package)
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    monkeypatch.delitem(sys.modules, "geomesh.integrations.lm_eval_adapter")
    monkeypatch.setattr(integrations, "lm_eval_adapter", lm_eval_adapter)
    code = eval_command.main(["default", "--tasks", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: ") and "geomesh[eval]" in err[0]


# ---- configuration -------------------------------------------------------------------------------------


@pytest.mark.parametrize("extra, field", [
    ({"model": {"hf_config": {"hidden_size": 8}}}, "model.hf_config.model_type"),
    ({"model": {"hf_config": [1, 2]}}, "model.hf_config"),
    ({"model": {"hf_config": {"model_type": "llama"}, "hf_pretrained": "x"}}, "model.hf_pretrained"),
    ({"data": {"format": "parquet"}}, "data.format"),
    ({"data": {"format": "tokens"}}, "data.tokens_file"),
    ({"data": {"tokens_file": "x.bin", "token_dtype": "int8"}}, "data.token_dtype"),
    ({"data": {"format": "hf"}}, "data.hf_dataset"),
    ({"data": {"tokenizer": "tok.json"}}, "data.tokenizer"),
    ({"data": {"tokens_file": "x.bin", "vocab_size": 70000}}, "data.vocab_size"),
    ({"logging": {"wandb": {"mode": "loud"}}}, "logging.wandb.mode"),
    ({"logging": {"tensorboard": 3}}, "logging.tensorboard"),
])  # fmt: skip
def test_integration_fields_are_validated(tmp_path, extra, field):
    d = tiny_scenario_dict(["x.txt"])
    for key, value in extra.items():
        d[key] = {**d.get(key, {}), **value}
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(d))
    with pytest.raises(ConfigError) as info:
        load_scenario(path)
    assert field in str(info.value)


def test_defaults_keep_the_builtin_behaviour():
    s = load_scenario("default")
    assert s.data.source() == "text" and not s.model.is_hf
    assert s.logging.tensorboard is None and s.logging.wandb is None
    ok = DataConfig(tokens_file="t.bin", token_dtype="uint32", vocab_size=100_000)
    assert ok.source() == "tokens"


# ---- transformers models -------------------------------------------------------------------------------


@needs_hf
@pytest.mark.parametrize("config", [LLAMA, GPT2], ids=["llama", "gpt2"])
def test_hf_model_has_the_builtin_interface(config):
    from geomesh.models import HFCausalLM
    from geomesh.models import build_proxy_model

    proxy = ModelConfig(seq_len=16, hf_config=dict(config))
    model = build_proxy_model(proxy, 300, seed=3)
    assert isinstance(model, HFCausalLM) and model.vocab_size == 300
    x = torch.randint(0, 300, (2, 16))
    y = torch.randint(0, 300, (2, 16))
    logits, loss = model(x, y)
    assert logits.shape == (2, 16, 300)
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 300), y.reshape(-1)))
    assert model(x)[1] is None
    assert model.num_params() == sum(p.numel() for p in model.parameters()) > 0
    again = build_proxy_model(proxy, 300, seed=3)
    other = build_proxy_model(proxy, 300, seed=4)
    pairs = list(zip(model.state_dict().values(), again.state_dict().values(), other.state_dict().values()))
    assert all(torch.equal(a, b) for a, b, _ in pairs)  # same seed: bit-identical
    assert not all(torch.equal(a, c) for a, _, c in pairs)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


@needs_hf
def test_hf_config_checks_vocabulary_and_length():
    from geomesh.models import build_hf_model

    with pytest.raises(ConfigError, match="vocab_size"):
        build_hf_model(ModelConfig(seq_len=16, hf_config={**LLAMA, "vocab_size": 100}), 300, 0)
    with pytest.raises(ConfigError, match="model.seq_len"):
        build_hf_model(ModelConfig(seq_len=128, hf_config=dict(GPT2)), 300, 0)
    with pytest.raises(ConfigError, match="model_type"):
        build_hf_model(ModelConfig(seq_len=16, hf_config={"model_type": "no-such-model"}), 300, 0)


@needs_hf
def test_hf_pretrained_from_a_local_folder(tmp_path):
    import transformers

    from geomesh.models import build_proxy_model

    config = transformers.AutoConfig.for_model(**{**LLAMA, "vocab_size": 320})
    torch.manual_seed(0)
    saved = transformers.AutoModelForCausalLM.from_config(config)
    saved.save_pretrained(tmp_path / "tiny")
    model = build_proxy_model(ModelConfig(seq_len=16, hf_pretrained=str(tmp_path / "tiny")), 300, seed=99)
    for (name, p), (_, q) in zip(model.hf.named_parameters(), saved.named_parameters()):
        assert torch.equal(p, q), name
    with pytest.raises(ConfigError, match="vocabulary"):
        build_proxy_model(ModelConfig(seq_len=16, hf_pretrained=str(tmp_path / "tiny")), 500, seed=0)
    with pytest.raises(ConfigError, match="config.json"):
        build_proxy_model(ModelConfig(seq_len=16, hf_pretrained=str(tmp_path)), 300, seed=0)


@needs_hf
def test_emulated_runtime_trains_a_transformers_model(tmp_path, small_corpus):
    s = scenario_from(tmp_path, small_corpus, model={"seq_len": 32, "hf_config": dict(LLAMA)},
                      training={"tokens": 12000})  # fmt: skip
    em, summary = run(s, "geomesh")
    curve = [c[2] for c in summary["curve"]]
    assert curve[-1] < curve[0] - 0.15
    assert summary["proxy_params"] == em.cluster.global_model.num_params()
    assert summary["zero_shot"]["items"] == 20
    # identical replicas start from the global model
    g = dict(em.cluster.global_model.named_parameters())
    assert set(g) == {n for n, _ in em.cluster.workers[0].model.named_parameters()}


@needs_hf
def test_emulated_runtime_trains_a_pretrained_folder(tmp_path, small_corpus):
    from geomesh.models import build_proxy_model

    model = build_proxy_model(ModelConfig(seq_len=32, hf_config=dict(GPT2)), 512, seed=0)
    model.save_pretrained(tmp_path / "gpt2-tiny")
    s = scenario_from(tmp_path, small_corpus, model={"seq_len": 32, "hf_pretrained": str(tmp_path / "gpt2-tiny")},
                      training={"tokens": 6000, "zero_shot_items": 0})  # fmt: skip
    em, summary = run(s, "diloco")
    assert summary["final_val_loss"] < summary["curve"][0][2]
    assert em.cluster.workers[1].model is not em.cluster.global_model


# ---- token files ---------------------------------------------------------------------------------------


@pytest.fixture
def text_corpus(small_corpus):
    return Corpus.load(CorpusSpec(paths=small_corpus[:1], vocab_size=512))


def test_memmap_stream_serves_the_same_batches_as_batchstream(tmp_path, text_corpus):
    from geomesh.data import MemmapBatchStream, TokenArray, open_token_files, write_token_file

    tokens = text_corpus.train_tokens[:20000].numpy()
    write_token_file(tmp_path / "a.bin", tokens)
    array = open_token_files(tmp_path / "a.bin")
    assert all(isinstance(p, np.memmap) for p in array.parts)  # nothing is loaded whole
    a = BatchStream(torch.from_numpy(tokens.astype(np.int64)), 32, seed=7)
    b = MemmapBatchStream(array, 32, seed=7)
    for n in (5, 300, 1, 400):  # crosses epoch boundaries
        xa, ya = a.next_batch(n)
        xb, yb = b.next_batch(n)
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    state = b.state_dict()
    c = MemmapBatchStream(array, 32, seed=7)
    c.load_state_dict(state)
    assert torch.equal(c.next_batch(3)[0], b.next_batch(3)[0])
    # shards split over files read as one run (a window may cross two files)
    write_token_file(tmp_path / "shards" / "00.bin", tokens[:7001])
    write_token_file(tmp_path / "shards" / "01.bin", tokens[7001:], dtype="uint16")
    split = open_token_files(tmp_path / "shards")
    assert isinstance(split, TokenArray) and len(split.parts) == 2
    assert np.array_equal(split.read(6990, 7010), tokens[6990:7010])
    assert np.array_equal(open_token_files(str(tmp_path / "shards" / "*.bin"))[100:200].read(0, 100), tokens[100:200])


def test_token_files_errors_name_the_file(tmp_path):
    from geomesh.data import open_token_files, write_token_file

    with pytest.raises(DataError, match="no such"):
        open_token_files(tmp_path / "missing.bin")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataError, match="odd.bin.*token_dtype"):
        open_token_files(tmp_path / "odd.bin")
    write_token_file(tmp_path / "big.bin", np.arange(4000) % 3000)
    with pytest.raises(DataError, match="vocabulary size 512"):
        load_corpus(DataConfig(tokens_file=str(tmp_path / "big.bin"), vocab_size=512))
    with pytest.raises(ValueError):
        write_token_file(tmp_path / "neg.bin", [-1])


def test_token_corpus_uint32_and_val_file(tmp_path):
    from geomesh.data import write_token_file

    rng = np.random.default_rng(0)
    write_token_file(tmp_path / "train.bin", rng.integers(0, 70000, 5000), dtype="uint32")
    write_token_file(tmp_path / "val.bin", rng.integers(0, 70000, 700), dtype="uint32")
    c = load_corpus(DataConfig(tokens_file=str(tmp_path / "train.bin"), val_tokens_file=str(tmp_path / "val.bin"),
                               token_dtype="uint32", vocab_size=70000))  # fmt: skip
    assert len(c.train) == 5000 and len(c.val_tokens) == 700 and c.vocab_size == 70000
    x, y = c.val_batches(32, 100)
    assert x.shape == (21, 32) and torch.equal(x[0, 1:], y[0, :-1])
    a, b = c.shard(0, 2), c.shard(1, 2)
    assert len(a) == len(b) == 2500
    x, y = c.batch_stream(1, 2, 32, seed=0).next_batch(4)
    assert x.dtype == torch.long and int(x.max()) < 70000


def test_emulated_runtime_trains_on_token_files(tmp_path, text_corpus):
    from geomesh.data import write_token_file

    write_token_file(tmp_path / "tokens.bin", text_corpus.tokens.numpy())
    s = scenario_from(tmp_path, ["unused"], data={"paths": None, "tokens_file": str(tmp_path / "tokens.bin"),
                                                  "vocab_size": text_corpus.vocab_size},
                      training={"tokens": 12000})  # fmt: skip
    em, summary = run(s, "geomesh")
    assert type(em.cluster.corpus).__name__ == "TokenCorpus"
    assert summary["curve"][-1][2] < summary["curve"][0][2] - 0.3
    assert summary["zero_shot"]["items"] == 20  # scored with token-count normalisation (no tokenizer given)


# ---- HF datasets ---------------------------------------------------------------------------------------


def _jsonl_docs(path: Path, source: str, field: str = "text") -> list[str]:
    docs = [d for d in Path(source).read_text().split("\n\n") if d.strip()]
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return docs


@needs_datasets
def test_hf_dataset_jsonl_is_streamed_into_a_token_cache(tmp_path, small_corpus, monkeypatch):
    from geomesh.data import hf as token_data

    _jsonl_docs(tmp_path / "docs.jsonl", small_corpus[0], field="body")
    d = DataConfig(format="hf", hf_dataset="json", paths=[str(tmp_path / "docs.jsonl")], text_field="body",
                   vocab_size=512)  # fmt: skip
    corpus = load_corpus(d, cache_dir=tmp_path / "cache")
    assert corpus.vocab_size <= 512 and corpus.eot_id is not None
    assert len(corpus.train) > 50_000 and len(corpus.val_tokens) > 1000
    assert all(isinstance(p, np.memmap) for p in corpus.train.parts)
    val = corpus.val_tokens.tolist()
    assert val[0] == corpus.eot_id  # documents are separated
    first_doc = val[1 : val.index(corpus.eot_id, 1)]
    text = corpus.tokenizer.decode(first_doc)
    assert text.strip() and text in Path(small_corpus[0]).read_text()
    # the second load reads the cache: no document is read again
    monkeypatch.setattr(token_data, "iter_hf_documents", lambda d: (_ for _ in ()).throw(AssertionError("reread")))
    again = load_corpus(d, cache_dir=tmp_path / "cache")
    assert np.array_equal(again.train.read(0, 1000), corpus.train.read(0, 1000))
    bad = DataConfig(format="hf", hf_dataset="json", paths=[str(tmp_path / "docs.jsonl")], text_field="nope")
    monkeypatch.undo()
    with pytest.raises(DataError, match="'nope'"):
        load_corpus(bad, cache_dir=tmp_path / "cache2")


@needs_datasets
def test_hf_dataset_text_parquet_tokenizer_and_max_tokens(tmp_path, small_corpus, text_corpus):
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [d for d in Path(small_corpus[0]).read_text().split("\n\n") if d.strip()]
    pq.write_table(pa.table({"text": docs}), tmp_path / "docs.parquet")
    text_corpus.tokenizer.save(str(tmp_path / "tokenizer.json"))
    d = DataConfig(format="hf", hf_dataset="parquet", paths=[str(tmp_path / "docs.parquet")],
                   tokenizer=str(tmp_path), max_tokens=30_000)  # fmt: skip
    c = load_corpus(d, cache_dir=tmp_path / "cache")
    assert len(c.train) + len(c.val) == 30_000
    assert c.vocab_size == text_corpus.vocab_size
    ids = text_corpus.tokenizer.encode(docs[0], add_special_tokens=False).ids
    assert c.train.read(1, 1 + len(ids)).tolist() == ids  # the given tokenizer, after the separator
    t = load_corpus(DataConfig(format="hf", hf_dataset="text", paths=[small_corpus[0]], vocab_size=400,
                               max_tokens=20_000), cache_dir=tmp_path / "cache")  # fmt: skip
    assert len(t.train) + len(t.val) == 20_000 and t.vocab_size <= 400
    with pytest.raises(DataError, match="no such"):
        load_corpus(DataConfig(format="hf", hf_dataset="json", paths=[str(tmp_path / "none.jsonl")]), tmp_path)


@needs_datasets
def test_emulated_runtime_trains_on_an_hf_dataset(tmp_path, small_corpus):
    _jsonl_docs(tmp_path / "docs.jsonl", small_corpus[0])
    s = scenario_from(tmp_path, ["unused"], data={"paths": [str(tmp_path / "docs.jsonl")], "format": "hf",
                                                  "hf_dataset": "json", "vocab_size": 512},
                      training={"tokens": 8000, "zero_shot_items": 0})  # fmt: skip
    _, summary = run(s, "diloco", cache_dir=tmp_path / "cache")
    assert summary["final_val_loss"] < summary["curve"][0][2]


# ---- telemetry sinks -----------------------------------------------------------------------------------


def test_every_record_reaches_the_sinks_and_a_broken_sink_is_dropped(tmp_path):
    from geomesh.telemetry_sinks import ListSink

    class Broken:
        closed = False

        def write(self, record):
            raise RuntimeError("disk full")

        def close(self):
            Broken.closed = True

    good = ListSink()
    t = Telemetry(tmp_path / "events.jsonl", sinks=[Broken(), good])
    with pytest.warns(UserWarning, match="Broken failed"):
        t.emit({"type": "run", "method": "geomesh"})
    t.span("w", "compute", 0.0, 1.0, 0)
    t.span("w", "straggler_wait", 1.0, 1.5, 0)
    t.emit({"type": "round", "round": 1, "time": 1.5, "tokens": 100, "compute_s": {"w": 1.0}, "exchange_s": 0.0,
            "bytes_sent": 10})  # fmt: skip
    t.evaluation(1.5, 100, 1, 2.0)
    t.close()
    assert len(good.records) == 5 and len(read_events(tmp_path / "events.jsonl")) == 5
    assert good.scalars["eval/perplexity"] == [(1, pytest.approx(math.exp(2.0)))]
    assert good.scalars["idle/straggler_frac"][-1] == (1, pytest.approx(0.5 / 1.5))
    assert good.scalars["round/bytes_sent"] == [(1, 10.0)] and good.scalars["compute_s/w"] == [(1, 1.0)]
    assert not Broken.closed  # dropped sinks are not closed twice


@needs_tb
def test_tensorboard_event_file_holds_the_runs_scalars(tmp_path, tiny_scenario):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    s = tiny_scenario()
    s.logging.tensorboard = True  # the scenario asks; the runtime attaches the sink itself
    em = EmulatedRun(s, get_method("geomesh"), RunOptions(out_dir=tmp_path / "run", progress=False))
    summary = em.run()
    files = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1
    acc = EventAccumulator(str(files[0].parent))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    workers = [r.name for r in s.regions]
    expected = {"eval/val_loss", "eval/perplexity", "idle/straggler_frac", "idle/wan_frac", "idle/utilization",
                "plan/exchange_bytes", "round/exchange_s"} | {f"plan/{w}/batch" for w in workers} | {
                f"plan/{w}/inner_steps" for w in workers}  # fmt: skip
    assert expected <= tags
    losses = [e.value for e in acc.Scalars("eval/val_loss")]
    assert losses == pytest.approx([c[2] for c in summary["curve"]], rel=1e-6)
    ppl = acc.Scalars("eval/perplexity")[-1].value
    assert ppl == pytest.approx(math.exp(summary["final_val_loss"]), rel=1e-5)
    idle = acc.Scalars("idle/straggler_frac")[-1].value
    assert idle == pytest.approx(summary["straggler_idle_frac"], rel=1e-5, abs=1e-7)
    plan = summary["plan"]["workers"][0]
    assert acc.Scalars(f"plan/{plan['name']}/batch")[-1].value == plan["batch"]
    # the JSONL log is unchanged by the sink
    assert read_events(tmp_path / "run" / "events.jsonl")[0]["type"] == "run"


@needs_tb
def test_tensorboard_folder_from_the_scenario(tmp_path):
    from geomesh.config import LoggingConfig
    from geomesh.telemetry_sinks import TensorBoardSink, make_sinks

    sinks = make_sinks(LoggingConfig(tensorboard=str(tmp_path / "tb")), None)
    assert isinstance(sinks[0], TensorBoardSink) and sinks[0].log_dir == tmp_path / "tb"
    sinks[0].close()
    with pytest.raises(ConfigError, match="run folder"):
        make_sinks(LoggingConfig(tensorboard=True), None)


def test_wandb_sink_logs_through_the_wandb_api(tmp_path, monkeypatch):
    from geomesh.config import LoggingConfig, WandbConfig
    from geomesh.telemetry_sinks import make_sinks

    calls = []

    class FakeRun:
        config = types.SimpleNamespace(update=lambda d, allow_val_change=False: calls.append(("config", d)))

        def log(self, data, step=None):
            calls.append(("log", step, data))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw)) or FakeRun()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    (sink,) = make_sinks(LoggingConfig(wandb=WandbConfig(project="geo", mode="offline")), tmp_path, run_name="r")
    t = Telemetry(None, sinks=[sink])
    t.emit({"type": "run", "method": "geomesh"})
    t.evaluation(0.0, 0, 0, 3.0)
    t.close()
    assert calls[0] == ("init", {"project": "geo", "config": {}, "name": "r", "mode": "offline", "dir": str(tmp_path)})
    assert ("config", {"method": "geomesh"}) in calls
    logged = [c for c in calls if c[0] == "log"]
    assert logged[0][1] == 0 and logged[0][2]["eval/val_loss"] == 3.0
    assert calls[-1] == ("finish",)


# ---- lm-evaluation-harness -----------------------------------------------------------------------------


class _Uniform(torch.nn.Module):
    """Logits that are equal everywhere: every token has probability 1/V."""

    def __init__(self, vocab: int, window: int):
        super().__init__()
        self.vocab, self.max_length = vocab, window
        self.calls: list[int] = []

    def forward(self, idx):
        self.calls.append(idx.shape[1])
        assert idx.shape[1] <= self.max_length
        return torch.zeros(*idx.shape, self.vocab), None


def test_lm_adapter_scores_like_the_model(text_corpus):
    """The adapter's loglikelihood equals the model's own log-probabilities (no lm-eval needed)."""
    from geomesh.integrations.lm_eval_adapter import GeoMeshLM
    from geomesh.models import build_model, model_config

    tok = text_corpus.tokenizer
    model = build_model(model_config("nano", vocab_size=tok.get_vocab_size(), seq_len=32), seed=1)
    lm = GeoMeshLM(model, tok, batch_size=2)
    ctx, cont = "To be, or not to be,", " that is the question"
    (ll, greedy), (empty, _) = lm.loglikelihood([(ctx, cont), ("", "Hamlet")])
    whole = tok.encode(ctx + cont, add_special_tokens=False).ids
    n_ctx = len(tok.encode(ctx, add_special_tokens=False).ids)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole[:-1]]))[0][0], -1)
    expected = sum(float(logp[i - 1, whole[i]]) for i in range(n_ctx, len(whole)))
    assert ll == pytest.approx(expected, rel=1e-5) and greedy is False
    eot = tok.token_to_id("<|endoftext|>")
    ids = tok.encode("Hamlet", add_special_tokens=False).ids
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([[eot] + ids[:-1]]))[0][0], -1)
    assert empty == pytest.approx(sum(float(logp[i, t]) for i, t in enumerate(ids)), rel=1e-5)
    # trailing spaces of the context move to the continuation
    assert lm.loglikelihood([("To be, or not to be, ", "that")])[0][0] == pytest.approx(
        lm.loglikelihood([("To be, or not to be,", " that")])[0][0])  # fmt: skip


def test_lm_adapter_rolling_windows_predict_each_token_once(text_corpus):
    from geomesh.integrations.lm_eval_adapter import GeoMeshLM

    tok = text_corpus.tokenizer
    model = _Uniform(tok.get_vocab_size(), window=16)
    lm = GeoMeshLM(model, tok)
    text = text_corpus.heldout_text()[0][:400]
    n = len(tok.encode(text, add_special_tokens=False).ids)
    (total,) = lm.loglikelihood_rolling([(text,)])
    assert n > 40 and total == pytest.approx(-n * math.log(tok.get_vocab_size()), rel=1e-6)
    assert max(model.calls) <= 16
    (out,) = lm.generate_until([("To be", {"until": ["\n"], "max_gen_toks": 5})])
    assert isinstance(out, str) and "\n" not in out


@needs_lm_eval
def test_lm_eval_runs_a_local_jsonl_task_offline(tmp_path, text_corpus):
    from geomesh.integrations.lm_eval_adapter import GeoMeshLM, evaluate_tasks
    from geomesh.models import build_model, model_config

    items = [{"question": "To be, or not to be, that is the", "choices": ["question", "banana", "seven"],
              "answer": 0} for _ in range(6)]  # fmt: skip
    (tmp_path / "items.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "toy.yaml").write_text(yaml.safe_dump({
        "task": "geomesh_toy_mc", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(tmp_path / "items.jsonl")}}, "test_split": "test",
        "output_type": "multiple_choice", "doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}],
    }))  # fmt: skip
    tok = text_corpus.tokenizer
    model = build_model(model_config("nano", vocab_size=tok.get_vocab_size(), seq_len=32), seed=1)
    lm = GeoMeshLM(model, tok)
    from lm_eval.api.model import LM

    assert isinstance(lm, LM)
    out = evaluate_tasks(lm, ["geomesh_toy_mc"], include_path=tmp_path / "tasks")
    metrics = out["results"]["geomesh_toy_mc"]
    # every item is the same, so the model picks the same choice each time: acc is 0 or 1
    chosen = max(range(3), key=lambda j: lm.loglikelihood([(items[0]["question"], " " + items[0]["choices"][j])])[0][0])
    assert metrics["acc,none"] == (1.0 if chosen == 0 else 0.0)
    assert metrics["sample_len"] == 6
    with pytest.raises(ConfigError, match="unknown lm-eval task"):
        evaluate_tasks(lm, ["no_such_task_xyz"], include_path=tmp_path / "tasks")


@needs_lm_eval
@needs_hf
def test_geomesh_eval_command_on_a_transformers_folder(tmp_path, text_corpus, capsys):
    import transformers

    from geomesh.cli.eval import main
    from geomesh.models import build_proxy_model

    model = build_proxy_model(ModelConfig(seq_len=32, hf_config=dict(GPT2)), text_corpus.vocab_size, seed=0)
    model.save_pretrained(tmp_path / "m")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=text_corpus.tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(tmp_path / "m")
    (tmp_path / "items.jsonl").write_text("".join(json.dumps({"q": "Good night, sweet", "c": ["prince", "cheese"],
                                                              "a": 0}) + "\n" for _ in range(3)))  # fmt: skip
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "t.yaml").write_text(yaml.safe_dump({
        "task": "geomesh_cli_mc", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(tmp_path / "items.jsonl")}},
        "output_type": "multiple_choice", "doc_to_text": "{{q}}", "doc_to_choice": "{{c}}", "doc_to_target": "{{a}}",
        "metric_list": [{"metric": "acc"}]}))  # fmt: skip
    code = main(["--hf-model", str(tmp_path / "m"), "--tasks", "geomesh_cli_mc", "--include-path",
                 str(tmp_path / "tasks"), "--out", str(tmp_path / "r.json")])  # fmt: skip
    assert code == 0
    assert "geomesh_cli_mc: " in capsys.readouterr().out
    result = json.loads((tmp_path / "r.json").read_text())
    assert 0.0 <= result["results"]["geomesh_cli_mc"]["acc,none"] <= 1.0
    assert result["model"]["model"] == str(tmp_path / "m")


@needs_lm_eval
def test_geomesh_eval_command_on_a_scenario_checkpoint(tmp_path, small_corpus, text_corpus):
    from geomesh.cli.eval import main
    from geomesh.models import build_proxy_model

    s_path = tmp_path / "s.yaml"
    d = tiny_scenario_dict(small_corpus)
    s_path.write_text(yaml.safe_dump(d))
    s = load_scenario(s_path)
    corpus = load_corpus(s.data)
    model = build_proxy_model(s.model, corpus.vocab_size, 5)
    torch.save({"model": model.state_dict()}, tmp_path / "ckpt.pt")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "items.jsonl").write_text(json.dumps({"q": "Lord", "c": ["Hamlet", "x"], "a": 0}) + "\n")
    (tmp_path / "tasks" / "t.yaml").write_text(yaml.safe_dump({
        "task": "geomesh_ckpt_mc", "dataset_path": "json", "test_split": "test",
        "dataset_kwargs": {"data_files": {"test": str(tmp_path / "items.jsonl")}},
        "output_type": "multiple_choice", "doc_to_text": "{{q}}", "doc_to_choice": "{{c}}", "doc_to_target": "{{a}}",
        "metric_list": [{"metric": "acc"}]}))  # fmt: skip
    out = tmp_path / "r.json"
    assert main([str(s_path), "--checkpoint", str(tmp_path / "ckpt.pt"), "--tasks", "geomesh_ckpt_mc",
                 "--include-path", str(tmp_path / "tasks"), "--out", str(out)]) == 0  # fmt: skip
    assert json.loads(out.read_text())["model"]["checkpoint"] == str(tmp_path / "ckpt.pt")
    torch.save({"nope": torch.zeros(1)}, tmp_path / "bad.pt")
    assert main([str(s_path), "--checkpoint", str(tmp_path / "bad.pt"), "--tasks", "geomesh_ckpt_mc",
                 "--include-path", str(tmp_path / "tasks")]) == 2  # fmt: skip


def test_builtin_zero_shot_needs_no_lm_eval(monkeypatch, tiny_scenario):
    monkeypatch.setitem(sys.modules, "lm_eval", None)
    _, summary = run(tiny_scenario(tokens=4000), "diloco")
    assert 0.0 <= summary["zero_shot"]["acc"] <= 1.0
