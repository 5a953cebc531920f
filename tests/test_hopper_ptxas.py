"""The warp-specialized GEMMs compiled for sm_90 on any machine (no GPU needed): ptxas keeps their
wgmmas pipelined and spills nothing.

A kernel whose wgmmas ptxas serializes (``C7515``: it finds a non-wgmma instruction defining
accumulator registers inside a pipeline stage, anywhere in the function) still computes the right
bits, so no GPU test would see it; it runs 7-19% slower. Two branches of the consumers' loop that
differ only in constant shared-memory offsets, which the compiler merges, are enough to cause it
(docs/design.md, section 12: Triton pitfalls)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton.experimental.gluon")


def _desc(shape) -> str:
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for(list(shape), gl.bfloat16)
    return f"tensordesc<bf16{list(shape)},{layout!r}>"


def _ptx(kernel: str, variant: str) -> str:
    """PTX of a kernel of ``_kernels/hopper_gemm.py`` for sm_90, as its launcher specializes it (run in a
    process of its own: the CPU suite's TRITON_INTERPRET=1 turns the kernel's plain Triton helpers into
    interpreted functions, which do not compile)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    from moekit._kernels import hopper_gemm
    from moekit._kernels.hopper_modes import ColSum, Epilogue

    if kernel == "rows":  # variant: "plain-bias-b-trans" or "swiglu-b-row-major"
        swiglu, b_trans = variant.startswith("swiglu"), variant.endswith("b-trans")
        fn = hopper_gemm._grouped_mm_ws_kernel
        sig = {"a_desc": _desc((128, 64)), "b_desc": _desc((1, 256, 64) if b_trans else (1, 64, 256)),
               "c_desc": _desc((64, 256)), "c_ptr": "*i32" if swiglu else "*bf16", "stride_c": "i32",
               "out2_ptr": "*bf16", "stride_out2": "i32", "bias_ptr": "*bf16", "stride_bias": "i32", "table": "*i32",
               "gscale_ptr": "*bf16", "N": "i32", "K": "i32"}
        consts = {"NUM_SMS": 132, "GROUP_M": 8, "STAGES": 3, "B_TRANS": b_trans, "HAS_BIAS": not swiglu,
                  "EPILOGUE": (Epilogue.SWIGLU if swiglu else Epilogue.PLAIN).value, "ALPHA": 1.0, "LIMIT": None,
                  "OFFSET": 0.0}
        divisible = range(3, 13)
    else:  # "ragged-k", variant: "ones-row"
        fn = hopper_gemm._grouped_mm_ws_ragged_k_kernel
        box = _desc((1, 1, 64, 64))
        sig = {"a_desc": box, "ones_desc": box, "b_desc": _desc((1, 1, 64, 256)), "c_desc": _desc((1, 64, 256)),
               "colsum_ptr": "*fp32", "stride_colsum": "i32", "offs_ptr": "*i32", "M": "i32", "N": "i32",
               "KT": "i32", "E": "i32"}
        consts = {"NUM_SMS": 132, "GROUP_M": 8, "STAGES": 3, "COLSUM": ColSum.ROW.value}
        divisible = range(4, 7)
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i in divisible}
    compiled = triton.compile(GluonASTSource(fn, sig, constexprs=consts, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, maxnreg=168))
    return compiled.asm["ptx"]


@pytest.mark.parametrize("kernel, variant", [("rows", "plain-bias-b-trans"), ("rows", "swiglu-b-row-major"),
                                             ("ragged-k", "ones-row")])
def test_wgmmas_pipelined_without_spills(tmp_path, kernel, variant):
    from triton.backends.nvidia.compiler import get_ptxas

    ptx = tmp_path / "k.ptx"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, __file__, str(ptx), kernel, variant], env=env, check=True)
    run = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", "--maxrregcount", "168", str(ptx),
                          "-o", str(tmp_path / "k.cubin")], capture_output=True, text=True, check=True)
    report = run.stdout + run.stderr
    assert "0 bytes spill stores, 0 bytes spill loads" in report, report
    assert "serialized" not in report, report


if __name__ == "__main__":  # python test_hopper_ptxas.py OUT.ptx KERNEL VARIANT
    out, kernel, variant = sys.argv[1:]
    with open(out, "w") as f:
        f.write(_ptx(kernel, variant))
