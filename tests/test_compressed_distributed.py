"""The compressed methods under `geomesh launch`: each trains in real rank processes as it does emulated.

`geomesh-sparse` (sparse sign payloads, error feedback in place of outer momentum), `sparseloco` (top-k with
2-bit values) and `diloco-int8` are all-gathered and combined by their codecs; their per-region state (the
error-feedback residual) lives in the region's leader. One launch each, 3 regions of one rank, no WAN shaper.
`streaming-diloco`'s one-line refusal is tested with the method (tests/test_streaming.py).
"""

from __future__ import annotations

import pytest
import torch
from test_distributed import assert_same_params, launch, write_scenario

from geomesh.config import load_scenario
from geomesh.methods import get_method
from geomesh.runtime.emulated import EmulatedRun, RunOptions

TOKENS = 6000


@pytest.mark.parametrize("method", ["geomesh-sparse", "sparseloco", "diloco-int8"])
def test_a_compressed_method_launches_and_equals_the_emulated_runtime(method, tmp_path, small_corpus):
    scenario = write_scenario(tmp_path, small_corpus, ("H100", "A100", "T4"), geomesh={"max_batch": 16})
    out = tmp_path / "run"
    result = launch([str(scenario), "--nproc", "3", "--method", method, "--out", str(out), "--tokens",
                     str(TOKENS), "--save-params", "--quiet", "--wan", "none", "--timeout", "60"])  # fmt: skip
    assert result.code == 0, result.message
    summary = result.summary
    assert summary["method"] == method and summary["collective"] == "all_gather"
    assert summary["rounds"] >= 2 and len(set(summary["param_checksums"])) == 1
    assert summary["rejected_payloads"] == 0

    emulated = EmulatedRun(load_scenario(scenario), get_method(method), RunOptions(tokens=TOKENS, progress=False))
    expected = emulated.run()
    assert summary["tokens"] == expected["tokens"] and summary["rounds"] == expected["rounds"]
    assert summary["plan"] == expected["plan"]
    # what crosses the WAN is the codec's payload, the same bytes as the emulated runtime counts
    assert 0 < summary["proxy_payload_bytes"] == expected["proxy_payload_bytes"]
    assert summary["final_val_loss"] == pytest.approx(expected["final_val_loss"], rel=1e-5)
    assert_same_params(torch.load(out / "final_params.pt"), emulated.cluster.global_model.state_dict(),
                       rtol=1e-5, atol=1e-6)  # fmt: skip
