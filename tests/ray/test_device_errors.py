"""`cluster.device` that the cluster cannot give: one line naming the key, exit code 2, before
any rank actor starts."""

from __future__ import annotations

from torch.utils import cpp_extension

from raytrain_dt.cli import main


def test_cuda_without_gpus_is_one_line(ray_cluster, capsys, tmp_path):
    code = main(["train", "conf/tiny.yaml", "cluster.device=cuda", f"run.dir={tmp_path}/r"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err == [
        "error: cluster.device=cuda: the Ray cluster has no GPUs; use cluster.device=auto, cpu "
        "or emulated, or join a cluster with GPU nodes (cluster.address)"
    ]
    assert not list((tmp_path / "r").glob("checkpoints/*"))


def test_emulated_device_that_cannot_be_built_is_one_line(
    ray_cluster, capsys, tmp_path, monkeypatch
):
    # A machine without a working C++ compiler: the build is attempted afresh and fails.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    # torch remembers, per process, each extension's build inputs (its build directory among
    # them) and bumps the name to `_v1` when they change: left behind, this attempt would make
    # this process's next load of the device library rebuild it (~20 CPU-s) as `_v1` in the
    # shared cache, and every rank process after it rebuild the original (ninja's build file
    # changed under it).
    monkeypatch.setattr(cpp_extension.JIT_EXTENSION_VERSIONER, "entries", {})
    monkeypatch.setenv("CXX", "/bin/false")
    code = main(["train", "conf/tiny.yaml", "cluster.device=emulated", f"run.dir={tmp_path}/r"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1
    assert err[0].startswith(
        "error: cluster.device=emulated: the emulated device could not be built ("
    )
    assert err[0].endswith("run `make install` (or `python -m raytrain_dt.accel.emulated.build`)")


def test_unknown_device_names_the_choices(capsys, tmp_path):
    code = main(["train", "conf/tiny.yaml", "cluster.device=tpu", f"run.dir={tmp_path}/r"])
    assert code == 2
    assert capsys.readouterr().err.strip() == (
        "error: cluster.device: 'tpu' is not one of auto, cpu, cuda, emulated"
    )
