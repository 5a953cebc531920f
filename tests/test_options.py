"""The options API, the install guards, and the same behaviour on the reference and kernel paths."""

import subprocess
import sys

import pytest
import torch

import moekit
from moekit import config, grouped_mm, grouped_mm_ref
from moekit.testing import offs_from_counts

BF16 = torch.bfloat16


def test_options_set_restore_and_reject_unknown():
    before = moekit.get_options()
    with moekit.options(save_h=False, warp_specialized=False) as opts:
        assert not opts.save_h and not config.save_h() and not opts.warp_specialized
        with moekit.options(save_h=True):
            assert config.save_h()
        assert not config.save_h()
    assert moekit.get_options() == before
    previous = moekit.set_options(debug=True)
    assert moekit.get_options().debug and previous == before
    moekit.set_options(**vars(previous))
    with pytest.raises(TypeError, match="unknown option"):
        moekit.set_options(no_such_option=True)


def test_gluon_quantize_only_on_cuda_and_only_when_on():
    assert not config.use_gluon_quantize(torch.device("cpu"))
    with moekit.options(gluon_quantize=False):
        assert not config.use_gluon_quantize(torch.device("cuda"))  # decided before any device query


def test_sm_margin_takes_sms_from_the_persistent_launches():
    cuda = torch.device("cuda", 0)
    config.target._sm_count.cache_clear()
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(config.target, "_sm_count", lambda index: 132)
            assert config.num_sms(cuda) == 132
            with moekit.options(sm_margin=20):
                assert config.num_sms(cuda) == 112 and moekit.get_options().sm_margin == 20
            with moekit.options(sm_margin=500):
                assert config.num_sms(cuda) == 1  # never below one program
            assert config.num_sms(cuda) == 132
    finally:
        config.target._sm_count.cache_clear()
    for bad in (-1, 1.5, True, "8"):
        with pytest.raises(ValueError, match="sm_margin must be an int >= 0"):
            moekit.set_options(sm_margin=bad)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})


def test_environment_gives_the_defaults_at_import():
    code = "import moekit; o = moekit.get_options(); print(o.save_h, o.tma, o.reference)"
    out = _python(code, MOEKIT_SAVE_H="0", MOEKIT_TMA="0", MOEKIT_REFERENCE="1")
    assert out.stdout.split() == ["False", "False", "True"], out.stderr
    bad = _python("import moekit", MOEKIT_SAVE_H="yes")
    assert bad.returncode != 0 and "MOEKIT_SAVE_H must be 0 or 1" in bad.stderr
    out = _python("import moekit; print(moekit.get_options().sm_margin)", MOEKIT_SM_MARGIN="16")
    assert out.stdout.split() == ["16"], out.stderr
    bad = _python("import moekit", MOEKIT_SM_MARGIN="-2")
    assert bad.returncode != 0 and "MOEKIT_SM_MARGIN must be a count >= 0" in bad.stderr


def test_untested_triton_stops_the_first_kernel_call(interpreter, monkeypatch):
    import triton

    monkeypatch.setattr(triton, "__version__", "3.9.0")
    config.check_triton.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"tested on Triton 3.6 and 3.7 only: pip install 'triton>=3.6,<3.8'"):
            grouped_mm(torch.randn(8, 16).to(BF16), torch.randn(1, 16, 16).to(BF16), offs_from_counts([8]))
        with moekit.options(reference=True):  # the reference runs with any Triton
            grouped_mm(torch.randn(8, 16).to(BF16), torch.randn(1, 16, 16).to(BF16), offs_from_counts([8]))
    finally:
        monkeypatch.undo()
        config.check_triton.cache_clear()


@pytest.mark.parametrize("offs", [[30, 10, 40], [5, 50, 20], [-3, 12, 12]], ids=["decreasing", "past-m", "negative"])
def test_bad_offs_give_the_same_shape_on_both_paths(interpreter, offs):
    """Without validate=True, bad offs are clamped the same way on both paths: (M, N) and (E, M, N)
    results, every element written (the poisoned output holds no NaN)."""
    a, b = torch.randn(40, 48).to(BF16), torch.randn(3, 48, 32).to(BF16)
    offs = torch.tensor(offs, dtype=torch.int32)
    got, want = grouped_mm(a, b, offs), grouped_mm_ref(a, b, offs)
    assert got.shape == want.shape == (40, 32) and not got.isnan().any()
    wgrad = grouped_mm(a.mT, torch.randn(40, 16).to(BF16), offs)
    assert wgrad.shape == (3, 48, 16) and not wgrad.isnan().any()


def test_compile_on_the_cpu_reference_says_what_to_do():
    a, b, offs = torch.randn(16, 32).to(BF16), torch.randn(2, 32, 24).to(BF16), offs_from_counts([8, 8])
    fn = torch.compile(lambda a, b, o: grouped_mm(a, b, o), fullgraph=True, backend="eager")
    with moekit.options(reference=True), pytest.raises(Exception, match="cannot be traced by torch.compile"):
        fn(a, b, offs)


@pytest.mark.parametrize("interpret, reference, expect", [
    ("1", "0", "CPU interpreter"),
    ("0", "0", "pure-PyTorch reference (no GPU"),
    ("1", "1", "pure-PyTorch reference (the reference option is on)"),
])
def test_info_tells_the_path(interpret, reference, expect):
    if torch.cuda.is_available():
        pytest.skip("describes a CPU-only machine")
    out = _python("from moekit.__main__ import main; main(['info'])", TRITON_INTERPRET=interpret,
                  MOEKIT_REFERENCE=reference)
    assert expect in out.stdout, out.stdout + out.stderr
