"""THE reader of compiled HLO text: a scheduled module as computations of typed instructions.

`computations(hlo)` maps each computation's name (the scheduled entry is "ENTRY") to its
instructions in order; an `Op` has its result `name`, `shape` text, `opcode` and full `text`,
with the JAX op that made it (`op_name`, from the metadata), its operand text and whether it is
a matmul kernel. `nbytes(shape)` is the bytes of an array or tuple shape. The overlap report
(`ladder_jax.analysis.overlap`) and the performance model (`ladder_jax.analysis.perfmodel`) read
programs only through this module.

What counts as a matmul kernel: a cuBLAS custom-call, a Triton GEMM fusion (`gemm_fusion*`:
deviceless builds are not autotuned), a plain `dot`, or any fusion whose JAX op is a
`dot_general` (at one token per row XLA rewrites small matmuls into multiply-reduce fusions,
which are still the module's matmul work).
"""

from __future__ import annotations

import dataclasses
import re

ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8\w*)\[([\d,]*)\]")
SCOPE = re.compile(r"layer(\d+)\.(attn|mlp|parallel)")


def nbytes(shape: str) -> int:
    total = 0
    for dtype, dims in ARRAY.findall(shape):
        bits = 8 if dtype == "pred" else 16 if dtype == "bf16" else int(
            re.match(r"[a-z]+?(\d+)", dtype).group(1))
        size = max(1, bits // 8)
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * size
    return total


@dataclasses.dataclass
class Op:
    name: str
    shape: str
    opcode: str
    text: str

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="((?:[^"\\]|\\.)*)"', self.text)
        return m.group(1) if m else ""

    @property
    def arguments(self) -> str:
        """The text after `opcode(`: the operands, then `)` and the attributes."""
        after_shape = _HEAD.match(self.text).end() + len(self.shape)
        start = self.text.index(self.opcode + "(", after_shape) + len(self.opcode) + 1
        return self.text[start:]

    def is_matmul(self) -> bool:
        if self.opcode in ("dot", "convolution"):
            return True
        if self.opcode == "custom-call":
            return bool(re.search(r'custom_call_target="__cu(blas|dnn)[^"]*', self.text))
        if self.opcode == "fusion":
            return (self.name.startswith(("gemm_fusion", "triton_gemm", "cublas"))
                    or "__triton_gemm" in self.text or self.op_name.endswith("dot_general"))
        return False


def computations(hlo: str) -> dict[str, list[Op]]:
    comps, current = {}, None
    for line in hlo.splitlines():
        if current is None:
            m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
            if m and not line.startswith(" "):
                current = "ENTRY" if m.group(1) else m.group(2)
                comps[current] = []
            continue
        if line.strip() == "}":
            current = None
            continue
        op = parse_instruction(line)
        if op:
            comps[current].append(op)
    return comps


_HEAD = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([\w\-$]+)\(")


def parse_instruction(line: str) -> Op | None:
    """`name = shape opcode(...)`; a tuple shape is matched by its parentheses (it may hold
    `/*index=5*/` comments and nested tuples)."""
    m = _HEAD.match(line)
    if not m:
        return None
    rest = line[m.end():]
    if rest.startswith("("):
        depth = 0
        for end, ch in enumerate(rest):
            depth += ch == "("
            depth -= ch == ")"
            if depth == 0:
                break
        shape, rest = rest[:end + 1], rest[end + 1:]
    else:
        shape, _, rest = rest.partition(" ")
        rest = " " + rest
    o = _OPCODE.match(rest)
    return Op(m.group(1), shape, o.group(1), line) if o else None
