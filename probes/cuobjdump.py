"""Triton's bundled cuobjdump on a kernel compiled without a GPU (``triton.compile(..., target=
GPUTarget("cuda", 90, 32))``): the probes that count SASS instructions and registers share this."""

import os
import re
import subprocess
import tempfile

import triton


def dump(kernel) -> tuple[str, list[str], str]:
    """A compiled kernel -> (its SASS, the opcodes in program order with their modifiers, the resource
    usage text: ``REG:``, ``STACK:``, ``SHARED:``, ``LOCAL:``)."""
    path = os.path.join(tempfile.mkdtemp(), "k.cubin")
    with open(path, "wb") as fh:
        fh.write(kernel.asm["cubin"])
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")

    def run(flag):
        return subprocess.run([f"{tools}/cuobjdump", flag, path], capture_output=True, text=True).stdout

    sass = run("-sass")
    ops = [m.group(1) for m in re.finditer(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)]
    return sass, ops, run("-res-usage")
