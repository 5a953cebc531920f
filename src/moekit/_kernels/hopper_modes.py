"""The modes of the warp-specialized kernels (``hopper_gemm.py``), defined once for the kernels and
their launchers (``moekit/hopper.py``). Kept free of Gluon imports, so the launchers import anywhere."""

import enum


class Epilogue(enum.IntEnum):
    """What the rows-ragged kernel does with its accumulator (``hopper_gemm.py`` describes each)."""

    PLAIN = 0  # c = a @ b[g] (+ bias[g])
    SWIGLU = 1  # the up-projection: c = aux, out2 = h = SwiGLU(aux)
    SWIGLU_NVFP4 = 3  # the up-projection writing h as NVFP4: c = values, out2 = scales (no aux)


class ColSum(enum.IntEnum):
    """How the ragged-K (weight-gradient) kernel also yields per-group column sums (bias gradients)."""

    NONE = 0
    ROW = 1  # a's last row holds ones; its product row is the column sum
    VIRTUAL = 2  # a constant row of ones multiplied in the empty half of the last row tile
