"""The emulated runtime's ``--device``: the proxy trains where it is told (bf16 autocast when the precision asks
for it), pseudo-gradients, θ and the outer step stay fp32, the modeled clock does not move; a device that
cannot be used is one clear error."""

from __future__ import annotations

import pytest
import torch

from geomesh.cli import main
from geomesh.methods import get_method
from geomesh.runtime.emulated import EmulatedRun, RunError, RunOptions

CLOCK = ("modeled_time_s", "rounds", "tokens", "bytes_sent", "straggler_idle_frac", "wan_idle_frac", "plan")


def run(scenario, method="diloco", **opts):
    em = EmulatedRun(scenario, get_method(method), RunOptions(progress=False, **opts))
    return em, em.run()


@pytest.mark.parametrize("method", ["diloco", "geomesh", "ddp"])
def test_bf16_autocast_trains_with_fp32_state_and_the_same_clock(tiny_scenario, method):
    s = tiny_scenario(tokens=6000, zero_shot_items=0)
    _, fp32 = run(s, method, device="cpu")
    s.training.precision = "bf16"
    em, bf16 = run(s, method, device="cpu")
    assert bf16["device"] == "cpu" and em.cluster.workers[0].autocast_dtype == torch.bfloat16
    assert bf16["final_val_loss"] != fp32["final_val_loss"]  # the forward really ran in bf16
    assert bf16["final_val_loss"] < bf16["curve"][0][2]  # it learned, about as much as in fp32
    assert abs(bf16["final_val_loss"] - fp32["final_val_loss"]) < 0.05 * fp32["final_val_loss"]
    for key in CLOCK:  # modeled time and bytes depend on the plan and the timing model only
        assert bf16[key] == fp32[key], key
    assert all(p.dtype == torch.float32 for p in em.cluster.global_model.parameters())
    for w in em.cluster.workers:
        assert all(p.dtype == torch.float32 for p in w.model.parameters())
        assert all(v.dtype == torch.float32 for st in w.optimizer.state.values() for v in st.values()
                   if torch.is_tensor(v) and v.is_floating_point())  # fmt: skip


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_one_clear_error(tiny_scenario, tmp_path, capsys):
    s = tiny_scenario()
    with pytest.raises(RunError, match="no CUDA device is available"):
        EmulatedRun(s, get_method("geomesh"), RunOptions(device="cuda"))
    for device, says in (("cuda", "no CUDA device is available"), ("tpu", "not a device"),
                         ("meta", "trains on cpu or cuda")):  # fmt: skip
        code = main(["train", str(tmp_path / "tiny.yaml"), "--method", "diloco", "--out", str(tmp_path / device),
                     "--device", device])  # fmt: skip
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"error: --device {device}") and says in err[0]
        assert not (tmp_path / device / "summary.json").exists()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["diloco", "geomesh", "ddp"])
def test_cuda_trains_the_proxy_on_the_gpu(tiny_scenario, method):
    s = tiny_scenario(tokens=6000, zero_shot_items=40)
    _, cpu = run(s, method, device="cpu")
    em, gpu = run(s, method, device="cuda")
    assert gpu["device"].startswith("cuda") and next(em.cluster.global_model.parameters()).is_cuda
    assert em.cluster.workers[0].autocast_dtype == torch.bfloat16  # precision auto: bf16 on a GPU that has it
    assert gpu["final_val_loss"] < gpu["curve"][0][2] - 0.3 and gpu["zero_shot"]["items"] == 40
    for key in CLOCK:
        assert gpu[key] == cpu[key], key
    with pytest.raises(RunError, match="worker processes train on the CPU"):
        EmulatedRun(s, get_method(method), RunOptions(device="cuda", workers_parallel=2))
