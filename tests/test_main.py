"""``python -m torchfuse``, the front door: on this machine's device every family's self-check runs
and passes, and a wrong result is reported as FAIL with exit status 1 (so the front door can fail)."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

import torchfuse
from torchfuse import reference, selfcheck
from torchfuse.selfcheck import runner

FAMILIES = {f.FAMILY for f in selfcheck.FAMILIES}


def test_cli_checks_every_family_and_passes(device):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.path.dirname(os.path.dirname(torchfuse.__file__)), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torchfuse", "--quick", "--check-only", "--json", "--device", device],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["ok"] and result["device"] == device and result["env"]["torch"] == torch.__version__
    checks = result["checks"]
    assert {c["family"] for c in checks} == FAMILIES
    have_transformers = importlib.util.find_spec("transformers") is not None
    for c in checks:
        # only a family whose optional dependency is missing may skip, and it says why
        assert c["result"] == "PASS" or (c["result"] == "SKIP" and c["family"] == "hf" and c["note"]
                                         and not have_transformers), c
        assert c["result"] == "SKIP" or c["err"] <= c["tol"], c
    ops = " ".join(c["op"] for c in checks)
    for op in ("add+layer_norm", "add+rms_norm", "backward", "jagged_to_padded_dense", "concat_2d_jagged",
               "jagged_dense_add", "jagged_concat", "hstu_attention backward dq", "hstu_attention_cached",
               "hstu_compute_output backward dattn",
               "insert + find", "training step", "DynamicEmbeddingBagCollection", "DynamicEmbeddingCollection"):
        assert op in ops, op
    assert result["bench"] == []


def test_wrong_reference_fails_with_exit_1(monkeypatch, capsys):
    """An RMSNorm whose output is 1% off (injected as the reference, so torchfuse disagrees with it)."""
    right = reference.add_rms_norm
    monkeypatch.setattr(reference, "add_rms_norm", lambda x, r, w, eps=1e-6: (right(x, r, w, eps)[0] * 1.01,
                                                                               right(x, r, w, eps)[1]))
    rc = runner.main(["--quick", "--check-only", "--families", "norm", "--device", "cpu"])
    out = capsys.readouterr().out
    assert rc == 1
    lines = {line[19:19 + 58].strip(): line for line in out.splitlines() if line.startswith("norm ")}
    assert lines["add+rms_norm y"].split()[-1] == "FAIL"
    assert lines["add+rms_norm x + residual"].split()[-1] == "PASS"  # the sum was left right
    assert lines["add+layer_norm y"].split()[-1] == "PASS"
    assert "CHECKS FAILED" in out


def test_a_family_that_raises_is_a_failure_not_a_crash(monkeypatch, capsys):
    def broken(ctx):
        raise RuntimeError("boom")
    monkeypatch.setattr(selfcheck.jagged, "checks", broken)
    result = runner.run(["--quick", "--check-only", "--families", "jagged,norm", "--device", "cpu", "--json"])
    assert not result["ok"]
    bad = [c for c in result["checks"] if c["result"] == "FAIL"]
    assert len(bad) == 1 and bad[0]["family"] == "jagged" and "boom" in bad[0]["note"]
    assert any(c["family"] == "norm" and c["result"] == "PASS" for c in result["checks"])  # the others still ran


def test_benchmark_rows_have_every_column(capsys):
    """One row per family asked for, with the eager ratio and the roofline (the times are not checked)."""
    result = runner.run(["--quick", "--bench-only", "--families", "norm,jagged", "--device", "cpu", "--json"])
    assert [r["family"] for r in result["bench"]] == ["norm", "jagged"]
    for r in result["bench"]:
        assert r["us"]["torchfuse"] > 0 and r["speedup"]["eager"] > 0 and r["roofline"] == "copy BW"
        assert "compile" not in r["us"]  # --quick on a CPU leaves torch.compile out


def test_plot_without_matplotlib_is_a_clear_error(monkeypatch, capsys):
    real = runner.importlib.util.find_spec
    monkeypatch.setattr(runner.importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert runner.main(["--quick", "--plot", "speedups.png"]) == 2
    assert "needs matplotlib" in capsys.readouterr().err


@pytest.mark.skipif(runner._module_exists("torchfuse.recsys.train"), reason="the training script exists")
def test_no_pointer_to_a_missing_training_script(capsys):
    assert runner.main(["--quick", "--check-only", "--families", "jagged", "--device", "cpu"]) == 0
    assert "recsys" not in capsys.readouterr().out
